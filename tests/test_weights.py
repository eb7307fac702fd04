"""Lazy bfloat16 reads: views of the file until used, the same values as the eager read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyinfer
from tests.conftest import build_hf_model
from tinyinfer.config import load_config
from tinyinfer.model import BUNDLED
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.tp.shard import shard_weights
from tinyinfer.weights import Bf16Array, load_weights, read_checkpoint


@pytest.fixture(scope="module")
def bundled():
    config = load_config(BUNDLED["bundled"])
    return config, load_weights(BUNDLED["bundled"], config), load_weights(BUNDLED["bundled"], config, lazy=True)


def test_bf16_tensors_stay_in_the_file_until_used(bundled):
    config, eager, lazy = bundled
    tensors, _ = read_checkpoint(BUNDLED["bundled"], lazy=True)
    assert tensors and all(isinstance(t, Bf16Array) for t in tensors.values())  # the bundled model is bf16
    assert all(isinstance(t, np.ndarray) for t in read_checkpoint(BUNDLED["bundled"])[0].values())
    w = lazy["layers.0.q.weight"]
    assert isinstance(w, Bf16Array) and w.shape == eager["layers.0.q.weight"].shape
    assert isinstance(w.bits, np.memmap)  # a view of the file, nothing read yet
    np.testing.assert_array_equal(np.asarray(w), eager["layers.0.q.weight"])
    np.testing.assert_array_equal(np.asarray(w[3:9, ::2].T), eager["layers.0.q.weight"][3:9, ::2].T)
    assert np.asarray(w, dtype=np.float64).dtype == np.float64


def test_torch_runner_from_lazy_weights_equals_eager(bundled):
    config, eager, lazy = bundled
    ids = [5, 6, 7, 8, 9]
    batch = make_batch([(ids, 0, [0], False)], 16)
    outputs = []
    for weights in (eager, lazy):
        runner = TorchRunner(config, weights, device="cpu", dtype="float32")
        outputs.append(runner.forward(batch, runner.new_kv_cache(4, 16)))
    np.testing.assert_array_equal(*outputs)  # bf16 -> float32 is exact either way


def test_tensor_parallel_shard_of_lazy_weights_is_lazy_and_equal(bundled):
    config, eager, lazy = bundled
    for rank in (0, 1):
        a, b = shard_weights(config, eager, rank, 2), shard_weights(config, lazy, rank, 2)
        assert a.keys() == b.keys()
        assert isinstance(b["layers.1.gate.weight"], Bf16Array) and isinstance(b["layers.1.o.weight"], Bf16Array)
        for name in a:
            np.testing.assert_array_equal(np.asarray(b[name]), a[name], err_msg=name)


def test_padded_vocabulary_shard_of_lazy_weights_stays_bf16(tmp_path):
    import transformers

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=321, n_embd=64, n_layer=1,
                                                              n_head=4, n_positions=64))
    hf.to(torch.bfloat16).save_pretrained(tmp_path)  # 321 rows: the second rank's shard is padded
    config = load_config(tmp_path)
    eager, lazy = load_weights(tmp_path, config), load_weights(tmp_path, config, lazy=True)
    for rank in (0, 1):
        embed = shard_weights(config, lazy, rank, 2)["embed"]
        assert isinstance(embed, Bf16Array)
        np.testing.assert_array_equal(np.asarray(embed), shard_weights(config, eager, rank, 2)["embed"])


def test_lazy_gpt2_transposed_weights_match_transformers(tmp_path):
    # GPT-2 stores Conv1D weights [in, out]: the lazy path transposes and slices views.
    hf = build_hf_model("gpt2", tmp_path, dtype=torch.bfloat16)
    model = tinyinfer.load(tmp_path, runner="torch", device="cpu", dtype="float32")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        expected = hf.float()(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.logits(ids), expected, atol=1e-4, rtol=1e-4)


def test_written_safetensors_read_back_in_the_library_and_in_torch(tmp_path):
    """The hand-written writer against the safetensors library as the oracle, bf16 included."""
    import os

    from safetensors.torch import load_file

    from tinyinfer.weights import float32_to_bf16_bits, write_safetensors

    rng = np.random.default_rng(0)
    plain = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
             "f16": rng.standard_normal(7).astype(np.float16),
             "i8": rng.integers(-128, 127, (2, 2, 3), dtype=np.int8),
             "u8": rng.integers(0, 255, 9, dtype=np.uint8), "empty": np.zeros((0, 4), np.float32)}
    values = rng.standard_normal((4, 6)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {**plain, "bf16": Bf16Array(float32_to_bf16_bits(values))},
                      metadata={"format": "pt"})
    back = load_file(str(path))  # the library's reader (its NumPy one has no bfloat16)
    expected_bf16 = torch.from_numpy(values).to(torch.bfloat16)  # torch rounds the same way
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], expected_bf16)
    for name, array in plain.items():
        read = back[name].numpy()
        assert read.dtype == array.dtype and np.array_equal(read, array), name
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not 0600
    with pytest.raises(tinyinfer.CheckpointError, match="dtype"):
        write_safetensors(tmp_path / "bad.safetensors", {"c": np.zeros(2, np.complex64)})
