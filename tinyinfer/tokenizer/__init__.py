"""Text ⇄ token ids: one Tokenizer interface, tiktoken where it is exact, `tokenizers` where not.

Modules, read in this order:

* `base`: the Tokenizer interface the engine, server, TUI and lessons call, and the
  IncrementalDecoder that streams text out of token ids.
* `convert`: a Hugging Face tokenizer.json in tiktoken's form (byte-level BPE), or why not.
* `tiktoken_backed`: the fast path lesson 01 teaches, and tiktoken's rank files.
* `hf_backed`: everything else, run by the Hugging Face `tokenizers` library itself.
* `loading`: which of the two runs a model folder's (or an in-memory) tokenizer.

Every public name is importable from `tinyinfer.tokenizer` itself.
"""

from tinyinfer.tokenizer.base import IncrementalDecoder, Tokenizer
from tinyinfer.tokenizer.convert import GPT2_PATTERN, ranks_from_tokenizer_json
from tinyinfer.tokenizer.hf_backed import HuggingFaceTokenizer
from tinyinfer.tokenizer.loading import from_hf_tokenizer, has_tokenizer_files, load_tokenizer
from tinyinfer.tokenizer.tiktoken_backed import (TiktokenTokenizer, read_tiktoken_ranks,
                                                 tiktoken_gpt2, write_tiktoken_ranks)

__all__ = [
    "GPT2_PATTERN", "HuggingFaceTokenizer", "IncrementalDecoder", "TiktokenTokenizer",
    "Tokenizer", "from_hf_tokenizer", "has_tokenizer_files", "load_tokenizer",
    "ranks_from_tokenizer_json", "read_tiktoken_ranks", "tiktoken_gpt2", "write_tiktoken_ranks",
]
