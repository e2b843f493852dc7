"""The AWQ GEMM layout: known packed words, pack -> unpack round trips, the written checkpoint's
tensors and config, and load -> the same logits as the in-memory quantized model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.core.errors import InputError
from geminicompress.formats import check_shapes
from geminicompress.formats.awq import AWQ_ORDER, pack_awq, unpack_awq
from geminicompress.formats.dequant import DequantLinear
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage


def test_one_word_holds_eight_outputs_in_interleaved_order():
    spec = QuantSpec(4, 4, sym=False)
    q = torch.arange(1, 9, dtype=torch.int32).view(8, 1).repeat(1, 4)  # output o has code o + 1
    qw = rtn_quantize(torch.randn(8, 4), spec)
    qw.q = q
    packed = pack_awq(qw)["qweight"]
    assert packed.shape == (4, 1) and packed.dtype == torch.int32
    expected = sum((AWQ_ORDER[i] + 1) << (4 * i) for i in range(8))  # nibble i = output AWQ_ORDER[i]
    assert expected == 0x86427531
    assert int(packed[0, 0]) & 0xFFFFFFFF == expected


@pytest.mark.parametrize("out_f,in_f,group,sym", [(16, 64, 32, False), (24, 128, 64, True), (8, 32, 32, False)])
def test_pack_unpack_round_trip(out_f, in_f, group, sym):
    spec = QuantSpec(4, group, sym=sym)
    qw = rtn_quantize(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)), spec)
    qw.scales = qw.scales.half().float()  # what the layout can hold
    packed = pack_awq(qw)
    assert packed["qweight"].shape == (in_f, out_f // 8) and packed["qzeros"].shape == (in_f // group, out_f // 8)
    assert packed["scales"].shape == (in_f // group, out_f) and packed["scales"].dtype == torch.float16
    back = unpack_awq(packed, spec)
    assert torch.equal(back.q, qw.q) and torch.equal(back.zeros, qw.zeros)  # real zero points, no -1
    assert torch.equal(back.scales, qw.scales) and torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.dequantize(), qw.dequantize())


@pytest.mark.parametrize("block_rows", [1, 3, None])  # None: one block
def test_packing_by_row_blocks_gives_the_same_words_and_codes(monkeypatch, block_rows):
    """Blocks of rows (the budget shrunk to 1 and 3 rows of the widest temporary) pack and unpack exactly as one
    block, and the reader's uint8 codes equal int32's (codes of 8..15 make words negative: the sign must not leak)."""
    from geminicompress.formats import awq

    spec = QuantSpec(4, 16, sym=False)
    qw = rtn_quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(1)), spec)
    qw.q = torch.randint(0, 16, qw.q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    qw.scales = qw.scales.half().float()  # what the layout can hold
    whole = pack_awq(qw)
    if block_rows:
        monkeypatch.setattr(awq, "BLOCK_BYTES", 8 * 40 * block_rows)  # pack: 8-byte codes of 40 outputs per row
    packed = pack_awq(qw)
    assert (packed["qweight"] < 0).any()
    assert torch.equal(packed["qweight"], whole["qweight"]) and torch.equal(packed["qzeros"], whole["qzeros"])
    wide, small = unpack_awq(packed, spec), unpack_awq(packed, spec, torch.uint8)
    assert wide.q.dtype == torch.int32 and small.q.dtype == torch.uint8
    assert torch.equal(wide.q, qw.q) and torch.equal(small.q.to(torch.int32), qw.q)
    assert torch.equal(small.dequantize(), qw.dequantize())


def test_shapes_the_layout_cannot_hold_are_refused_with_the_fix():
    with pytest.raises(InputError, match="4-bit.*compressed-tensors"):
        check_shapes("awq", {"l": (16, 64)}, QuantSpec(3, 32))
    with pytest.raises(InputError, match="divisor of 576"):
        check_shapes("awq", {"l": (16, 576)}, QuantSpec(4, 128))
    with pytest.raises(InputError, match="l has 64 inputs and the group size is -1"):  # no per-channel layout
        check_shapes("awq", {"l": (16, 64)}, QuantSpec(4, -1))
    with pytest.raises(InputError, match="8 outputs"):
        check_shapes("awq", {"l": (12, 64)}, QuantSpec(4, 32))
    check_shapes("awq", {"l": (576, 576)}, QuantSpec(4, 64))


def test_checkpoint_tensors_config_and_logits(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    recipe = recipe_from_stage(str(tiny_dir), {"type": "quantize", "method": "awq", "group_size": 32},
                               {"data": str(text_file), "samples": 4, "seq_len": 48}, "test")
    loaded = load_model(str(tiny_dir))
    report = run_recipe(recipe, out, RunOptions(device=torch.device("cpu")), loaded=loaded)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["bits"] == 4 and qc["group_size"] == 32
    assert qc["zero_point"] is True and qc["version"] == "gemm" and qc["modules_to_not_convert"] == ["lm_head"]
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    assert tensors[f"{name}.qweight"].shape == (128, 64 // 8) and tensors[f"{name}.qweight"].dtype == torch.int32
    assert tensors[f"{name}.qzeros"].shape == (128 // 32, 64 // 8)
    assert tensors[f"{name}.scales"].shape == (128 // 32, 64) and f"{name}.weight" not in tensors
    assert "lm_head.weight" in tensors and report["export"]["quantized_modules"] == 14
    back = load_model(str(out))
    assert back.format == "awq" and isinstance(back.model.model.layers[0].mlp.down_proj, DequantLinear)
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids).logits, loaded.model(ids).logits, atol=1e-5, rtol=1e-5)
        # the in-memory weights are exactly the packed codes times the fp16 scales
        torch.testing.assert_close(back.model.model.layers[1].self_attn.q_proj.weight,
                                   loaded.model.model.layers[1].self_attn.q_proj.weight, atol=0, rtol=0)
