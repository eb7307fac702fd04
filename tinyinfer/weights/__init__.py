"""Checkpoint files → the named arrays both runners read.

* `safetensors_file`: Hugging Face folders (``*.safetensors``), read and written by hand.
* `gguf_file`: GGUF files (llama.cpp's format), read with the ``gguf`` package; block formats
  that are tinyinfer formats stay quantized.
* `names`: Hugging Face tensor names → tinyinfer's names, every shape checked.

Every public name is importable from `tinyinfer.weights` itself.
"""

from tinyinfer.weights.names import internal_shapes, load_weights, map_weights
from tinyinfer.weights.safetensors_file import (Bf16Array, WeightArray, bf16_bits_to_float32,
                                                float32_to_bf16_bits, read_checkpoint,
                                                read_safetensors, write_safetensors)

__all__ = [
    "Bf16Array", "WeightArray", "bf16_bits_to_float32", "float32_to_bf16_bits", "internal_shapes",
    "load_weights", "map_weights", "read_checkpoint", "read_safetensors", "write_safetensors",
]
