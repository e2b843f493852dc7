"""The announced peak of a streamed run (engine/estimate.py), phase by phase, on a tiny checkpoint whose
vocabulary outweighs its layers (the shape of a 262,144-token model): the figures the formula must give,
from the tensor shapes alone. The real peaks they were fitted to are in docs/streaming.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import save_sharded

from geminicompress.engine import estimate as est
from geminicompress.core.rows import BLOCK_BYTES
from geminicompress.models.lazy import LazyCheckpoint

V, D, I = 8192, 64, 128  # vocabulary, hidden, intermediate: the table (1 MiB in bfloat16) dwarfs a layer
MAX_SHARD = 1 << 30
LOGITS = 3 * 2 * 64 * V * 4  # the check's three (2, 64, V) float32 logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> LazyCheckpoint:
    path = save_sharded(tmp_path_factory.mktemp("big_vocab") / "m", num_hidden_layers=2, vocab_size=V,
                        tie_word_embeddings=False)
    return LazyCheckpoint(Path(path))


def _sizes(ckpt, *dtypes) -> est.Sizes:
    return est.read_sizes(ckpt, dtypes or (torch.bfloat16,))


def _peak(ckpt, **kwargs) -> int:
    args = {"out_dtype": torch.bfloat16, "quantized": False, "max_shard": MAX_SHARD, **kwargs}
    return est.estimate(ckpt, **args)["peak_memory_bytes"] - est.BASE_BYTES


def test_a_head_written_as_read_counts_once_and_the_check_holds_it_with_its_logits(ckpt):
    table = V * D * 2  # bfloat16
    assert ckpt.nbytes("lm_head") == ckpt.nbytes("model.embed_tokens") == table
    # uncalibrated, output dtype as stored: the check (head as stored, a block of rows, the logits) is the peak;
    # the old "read + written copy" counted 2 x table for a table that is written as read
    assert _peak(ckpt) == table + BLOCK_BYTES + LOGITS


def test_a_head_written_in_another_dtype_adds_its_written_copy(ckpt):
    table = V * D * 2
    outside = est.outside_phase(_sizes(ckpt, torch.float32), torch.float32, frozenset())
    assert outside == table + V * D * 4  # read as stored + written in float32
    assert est.outside_phase(_sizes(ckpt), torch.bfloat16, frozenset()) == table


def test_an_int8_head_counts_its_codes_and_the_kernels_copies(ckpt, monkeypatch):
    table, n, block = V * D * 2, V * D, 4096
    monkeypatch.setattr(est, "BLOCK_BYTES", block)  # smaller than the head's copies, as at 262k x 4,096
    changed = frozenset({"lm_head"})
    sizes = _sizes(ckpt)
    assert est.outside_phase(sizes, torch.bfloat16, changed) == table + 3 * n + 2 * block  # codes, shifted, packed
    # the codes, the float16 packs and the float32 rows they are packed from
    assert est.check_phase(sizes, changed) == table + n * (1 + 2) + n * 4 + LOGITS
    monkeypatch.setattr(est, "PACK_BYTES", block)  # at 262k x 4,096 the kernel packs 256 MiB of float32 rows at a time
    assert est.check_phase(sizes, changed) == table + n * (1 + 2) + block + LOGITS
    assert est.check_phase(sizes, frozenset()) == table + block + LOGITS
    assert _peak(ckpt, quantized=True, changed=changed) == max(est.outside_phase(sizes, torch.bfloat16, changed),
                                                               est.check_phase(sizes, changed))


def test_a_calibrated_run_counts_the_capture_of_layer_0s_inputs(ckpt):
    """GPTQ's walk on a bfloat16 checkpoint: the table read as stored while every window's layer-0 inputs are
    captured (the rows looked up in float32, the store in the calibration dtype), beside the layer's own phase."""
    n, T = 64, 512
    calib = est.Calibration((n, T), torch.bfloat16, torch.bfloat16, one_pass=False, squares=1)
    capture = V * D * 2 + n * T * D * (4 + 2)
    sizes = _sizes(ckpt)
    layer = est.layer_phase(sizes, calib)
    assert layer < capture  # on this shape the capture is bigger than a layer's work
    assert _peak(ckpt, quantized=True, calib=calib) == max(layer, capture, est.check_phase(sizes, frozenset()))


def test_the_phases_are_arithmetic_on_sizes_read_once():
    """No checkpoint: the phases of a made-up shape, by hand (a 2-layer model, a 1,000 x 16 head)."""
    f32, bf16, i8, f16 = torch.float32, torch.bfloat16, torch.int8, torch.float16
    sizes = est.Sizes(layers=[{None: 100, f32: 200, bf16: 100}, {None: 120, f32: 240, bf16: 120}],
                      outside={"lm_head": {None: 32_000, f32: 64_000, bf16: 32_000, i8: 16_000}},
                      head="lm_head", head_bytes={None: 32_000, i8: 16_000, f16: 32_000, f32: 64_000},
                      head_rows=1000, embed=32_000, biggest=10, widest=8, hidden=4, tensors=[("w", 50, bf16)])
    assert est.layer_phase(sizes, None) == 120 + 3 * 4 * 10
    calib = est.Calibration((2, 3), f32, bf16, one_pass=True, squares=2)
    assert est.layer_phase(sizes, calib) == 120 + 240 + 2 * 3 * (8 + 3 * 4) * 4 + 2 * 4 * 8**2 + 3 * 4 * 10
    assert est.outside_phase(sizes, f32, frozenset()) == 32_000 + 64_000
    assert est.outside_phase(sizes, bf16, frozenset({"lm_head"})) == 32_000 + 3 * 16_000 + 2 * BLOCK_BYTES
    logits = 3 * est.PROBE_WINDOWS * est.PROBE_TOKENS * 1000 * 4
    assert est.check_phase(sizes, frozenset()) == 32_000 + BLOCK_BYTES + logits
    got = est.peak(sizes, bf16, False, MAX_SHARD, calib)
    assert got["disk_bytes"] == 2 * (50 * 2) and got["peak_memory_bytes"] == est.BASE_BYTES + max(
        est.layer_phase(sizes, calib), est.outside_phase(sizes, bf16, frozenset()),
        est.check_phase(sizes, frozenset()), 32_000 + 2 * 3 * 4 * (4 + 4))
