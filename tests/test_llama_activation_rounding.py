"""benchmarks/reproduce/gguf_torch_check.py rounds each linear's input as llama.cpp's CPU kernels do before a
quantized dot product (Q8_0 for the 32-blocks, Q8_K for the K types): the rounding must be ggml's, or the
check would explain llama.cpp's perplexity with the wrong arithmetic."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce"))
from gguf_torch_check import q8_0, q8_k  # noqa: E402


def test_q8_0_is_ggufs_q8_0_round_trip():
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 3
    ref = quants.dequantize(quants.quantize(x.numpy(), T.Q8_0), T.Q8_0)
    ours = q8_0(x).numpy()
    step = np.abs(x.numpy()).reshape(64, 16, 32).max(-1, keepdims=True) / 127
    diff = np.abs(ours - ref).reshape(64, 16, 32)
    assert (diff == 0).mean() > 0.999 and bool((diff <= step * 1.001).all())  # a rounding tie at most: one step


def test_q8_k_keeps_its_grid_and_rounds_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1024, generator=g)
    y = q8_k(x)
    blocks, out = x.unflatten(-1, (-1, 256)), y.unflatten(-1, (-1, 256))
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert bool(((out - blocks).abs() <= step / 2 * (1 + 1e-5)).all())
    assert torch.allclose(q8_k(y), y, rtol=1e-6, atol=0)  # on the grid already: unchanged (to float rounding)
    assert torch.equal(q8_k(torch.zeros(2, 256)), torch.zeros(2, 256))
    # the extreme of each block is held exactly, whatever its sign (ggml scales by -127 / the signed extreme)
    idx = blocks.abs().argmax(-1, keepdim=True)
    assert torch.allclose(out.gather(-1, idx), blocks.gather(-1, idx), rtol=1e-6, atol=0)
