"""torch's int4 kernel for our packed formats (kernels/int4.py, eval/engines/torch_kernels.py): the zero-point conversion
gives back the checkpoint's weights, the kernel's outputs equal the reference path's within the
activation dtype's rounding, act-order / per-channel / 3-bit layouts, refusals with their reasons, and a
whole GPTQ / AWQ / pack-quantized model's perplexity through the fast path against the reference path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.eval.engines.torch_kernels import expects_int4, use_fast_kernels
from geminicompress.formats.dequant import DequantLinear
from geminicompress.kernels.int4 import Int4Linear, dequantize_layout, int4_layout
from geminicompress.runtime.pipeline import RunOptions

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _qweight(out_f=48, in_f=128, bits=4, group=32, act_order=False, seed=0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    spec = QuantSpec(bits, group, sym=False)
    groups = spec.groups(in_f)
    q = torch.randint(0, 2**bits, (out_f, in_f), generator=gen, dtype=torch.int32)
    scales = (torch.rand(out_f, groups, generator=gen) * 0.02 + 0.001).half().float()  # as GPTQ stores them
    zeros = torch.randint(0, 2**bits, (out_f, groups), generator=gen, dtype=torch.int32)
    size = in_f if group == -1 else group
    g_idx = torch.arange(in_f, dtype=torch.int32) // size
    if act_order:  # GPTQ desc_act: column j belongs to the group of its position in a permuted order
        order = torch.randperm(in_f, generator=gen)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[order] = torch.arange(in_f, dtype=torch.int32) // size
    return QuantizedWeight(q, scales, zeros, g_idx, spec)


CASES = [dict(), dict(act_order=True), dict(group=-1), dict(group=64), dict(group=128, in_f=256),
         dict(bits=3), dict(bits=2, act_order=True), dict(group=512, in_f=1024)]


@pytest.mark.parametrize("case", CASES, ids=[str(c) or "g32" for c in CASES])
def test_zero_point_conversion_gives_back_the_checkpoint_weights(case):
    """S·(q − 8) + Z with S = s, Z = s·(8 − z) is s·(q − z): equal to float32 rounding of two products,
    and within bf16 rounding of S and Z when the kernel holds them in bf16."""
    qw = _qweight(**case)
    ref = DequantLinear(qw).weight  # (out, in) float32: s·(q − z)
    layout = int4_layout(qw.q, qw.scales, qw.zeros, qw.g_idx, qw.spec.bits)
    assert not isinstance(layout, str), layout
    assert layout.group_size in (32, 64, 128, 256)
    assert (layout.perm is not None) == case.get("act_order", False)
    fp32 = dequantize_layout(layout, torch.float32)
    assert torch.allclose(fp32, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    bf16 = dequantize_layout(layout, torch.bfloat16)
    # S and Z each rounded to bf16 (relative 2^-9): |Δw| <= |S|·|q − 8|·2^-9 + |Z|·2^-9
    s = qw.scales.max()
    assert float((bf16 - ref).abs().max()) <= float(s) * (2**qw.spec.bits + 8) * 2**-8


@pytest.mark.parametrize("case", CASES[:6], ids=[str(c) or "g32" for c in CASES[:6]])
def test_kernel_output_equals_the_reference_path(case):
    qw = _qweight(**case)
    bias = torch.randn(qw.q.shape[0]) * 0.1
    ref_mod = DequantLinear(qw, bias)
    layout = int4_layout(qw.q, qw.scales, qw.zeros, qw.g_idx, qw.spec.bits)
    x = torch.randn(5, 3, qw.q.shape[1], generator=torch.Generator().manual_seed(1))
    # float32 activations: the kernel's arithmetic on the same weights, to float32 accumulation order
    fast32 = Int4Linear(layout, qw.spec.bits, bias, torch.float32, CPU)
    y32, ref32 = fast32(x), ref_mod(x)
    assert y32.shape == ref32.shape == (5, 3, qw.q.shape[0])
    assert torch.allclose(y32, ref32, rtol=1e-4, atol=1e-4 * float(ref32.abs().max()))
    # bf16 activations (the fast path on a CPU): against the same weights in float32, bf16 rounding
    fast16 = Int4Linear(layout, qw.spec.bits, bias, torch.bfloat16, CPU)
    xb = x.bfloat16()
    y16 = fast16(xb)
    assert y16.dtype == torch.bfloat16
    exact = F.linear(xb.float(), dequantize_layout(layout, torch.bfloat16), bias.bfloat16().float())
    assert float((y16.float() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())


@pytest.mark.parametrize("case", [dict(out_f=128), dict(out_f=128, act_order=True), dict(out_f=64, group=-1),
                                  dict(out_f=128, bits=3)], ids=["g32", "act_order", "per_channel", "3bit"])
def test_prefill_dequantizes_once_and_equals_the_kernel(case):
    """From PREFILL_ROWS rows on the weight is read back from the packed codes and run as one bf16 GEMM: the
    same weights as the kernel's, within bf16 rounding; fewer rows stay on the kernel."""
    from geminicompress.kernels import int4

    qw = _qweight(**case)
    layout = int4_layout(qw.q, qw.scales, qw.zeros, qw.g_idx, qw.spec.bits)
    fast = Int4Linear(layout, qw.spec.bits, None, torch.bfloat16, CPU)
    assert fast.block is not None  # this torch's CPU packing is read back exactly
    assert torch.equal(int4.unpack_cpu(fast.packed, *layout.codes.shape, fast.block).t(), layout.codes.to(torch.uint8))
    w_t = int4.dequantize_packed(fast.packed, fast.block, fast.group_size, fast.offsets, fast.scales_and_zeros[..., 0],
                                 fast.out_features, fast.in_features)
    if layout.perm is None:  # the kernel's weights, rounded once more to bf16
        want = dequantize_layout(layout, torch.bfloat16)
        assert float((w_t.float().t() - want).abs().max()) <= 2**-7 * float(want.abs().max())  # 1-2 bf16 ulps
    x = torch.randn(int4.PREFILL_ROWS, qw.q.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    calls = []
    kernel = int4.int4_mm
    try:
        int4.int4_mm = lambda *a: calls.append(a[0].shape[0]) or kernel(*a)
        prefill, decode_rows = fast(x), fast(x[:4])
    finally:
        int4.int4_mm = kernel
    assert calls == [4]  # the long call went through the GEMM, the short one through the kernel
    by_kernel = kernel(x.index_select(1, fast.perm) if fast.perm is not None else x, fast.packed, fast.group_size,
                       fast.scales_and_zeros)
    exact = F.linear(x.float(), dequantize_layout(layout, torch.bfloat16))
    assert float((prefill.float() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())
    assert float((prefill.float() - by_kernel.float()).abs().max()) <= 2**-6 * float(exact.abs().max())
    torch.testing.assert_close(decode_rows, by_kernel[:4], rtol=0, atol=0)


@pytest.mark.parametrize("case,reason", [
    (dict(bits=8), "8-bit codes do not fit"),
    (dict(out_f=40), "40 output features: torch's int4 kernel needs a multiple of 16"),
    (dict(group=16), "groups of 16 columns"),
])
def test_layouts_the_kernel_cannot_hold_say_why(case, reason):
    qw = _qweight(**case)
    got = int4_layout(qw.q, qw.scales, qw.zeros, qw.g_idx, qw.spec.bits)
    assert isinstance(got, str) and reason in got


def test_expects_int4_from_config_alone():
    assert expects_int4({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert expects_int4({"quantization_config": {"quant_method": "awq", "bits": 4}})
    assert not expects_int4({"quantization_config": {"quant_method": "gptq", "bits": 8}})
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}
    assert expects_int4({"quantization_config": ct})
    assert not expects_int4({"quantization_config": {**ct, "format": "int-quantized"}})
    assert not expects_int4({})


# --------------------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def packed_models(tmp_path_factory, text_file):
    from tiny import save_tiny

    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    root = tmp_path_factory.mktemp("int4")
    base = save_tiny(root / "base")
    calib = {"data": str(text_file), "samples": 4, "seq_len": 64}
    stages = {
        "gptq-actorder": {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 32, "act_order": True},
        "gptq-ct": {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 32, "act_order": False,
                    "format": "compressed-tensors", "sym": False},
        "awq": {"type": "quantize", "method": "awq", "bits": 4, "group_size": 32, "n_grid": 4},
        "gptq-3bit": {"type": "quantize", "method": "gptq", "bits": 3, "group_size": 32},
    }
    out = {}
    for name, stage in stages.items():
        recipe = recipe_from_stage(str(base), stage, calib, "test")
        run_recipe(recipe, root / name, RunOptions(device=CPU, stream=False), loaded=load_model(str(base)))
        out[name] = root / name
    return base, out


def _windows(tok, text_file, n=4, seq=64):
    from geminicompress.data import pack_windows, tokenize

    return pack_windows(tokenize(tok, text_file.read_text(), n * seq), seq)


@pytest.mark.parametrize("name", ["gptq-actorder", "gptq-ct", "awq", "gptq-3bit"])
def test_model_quality_through_the_fast_path_equals_the_reference_path(packed_models, text_file, name):
    from geminicompress.eval.quality.perplexity import perplexity
    from geminicompress.models.loading import load_model

    _, outs = packed_models
    loaded = load_model(str(outs[name]))
    windows = _windows(loaded.tokenizer, text_file)
    ref_ppl = perplexity(loaded.model, windows, "cpu")
    with torch.no_grad():
        ref_logits = loaded.model(windows[:1]).logits
    choice = use_fast_kernels(loaded.model, CPU)
    assert choice.kernel == "torch-int4-cpu" and choice.timed and choice.activation_dtype == "bfloat16"
    assert not any(isinstance(m, DequantLinear) for m in loaded.model.modules())
    assert sum(choice.modules.values()) == 14  # 2 layers x 7 linears
    fast_ppl = perplexity(loaded.model, windows, "cpu")
    with torch.no_grad():
        fast_logits = loaded.model(windows[:1]).logits.float()
    # bf16 activations through 2 layers: logits within a few bf16 steps of their scale, ppl within 0.5%
    assert float((fast_logits - ref_logits).abs().max()) < 0.05 * float(ref_logits.abs().max())
    assert fast_ppl == pytest.approx(ref_ppl, rel=5e-3)
    if name == "gptq-3bit":
        assert "3-bit codes run in the int4 kernel" in choice.note


def test_8bit_grouped_model_runs_dequantized_once_and_is_not_timed(tmp_path, text_file):
    """8-bit codes with groups have no kernel here: their weights are dequantized once into dense linears (the
    same logits as the reference path, which dequantizes on every call); latency is not measured."""
    from tiny import save_tiny

    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    base = save_tiny(tmp_path / "base")
    recipe = recipe_from_stage(str(base), {"type": "quantize", "method": "rtn", "bits": 8, "group_size": 32},
                               {"data": str(text_file), "samples": 2, "seq_len": 64}, "test")
    run_recipe(recipe, tmp_path / "rtn8", RunOptions(device=CPU, stream=False), loaded=load_model(str(base)))
    loaded = load_model(str(tmp_path / "rtn8"))
    x = torch.randint(0, 300, (1, 32))
    with torch.no_grad():
        ref = loaded.model(x).logits
        choice = use_fast_kernels(loaded.model, CPU)
        got = loaded.model(x).logits
    assert not choice.timed and choice.kernel == "dense-dequantized" and choice.modules == {"dense-dequantized": 14}
    assert "14 8-bit linears with groups or zero points have no kernel on cpu" in choice.note
    assert not any(isinstance(m, DequantLinear) for m in loaded.model.modules())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_dense_and_int8_models_keep_their_kernels(tiny_dir):
    from tiny import prune_in_place

    from geminicompress.models.loading import load_model

    loaded = load_model(str(tiny_dir))
    choice = use_fast_kernels(loaded.model, CPU, sparsity=0.0)
    assert choice.kernel == "dense" and choice.timed and choice.note is None
    prune_in_place(loaded.model, 0.5)
    assert "unstructured sparsity runs dense" in use_fast_kernels(loaded.model, CPU, sparsity=0.5).note
    with torch.no_grad():  # 2:4: the two smallest of every 4 inputs zeroed
        for name, m in loaded.model.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
                w = m.weight.view(-1, 4)
                w.scatter_(1, w.abs().argsort(1)[:, :2], 0.0)
    assert "2:4 sparsity runs dense here" in use_fast_kernels(loaded.model, CPU, sparsity=0.5).note


def test_8bit_symmetric_per_channel_runs_fbgemm_exactly(tmp_path, text_file):
    """8-bit symmetric per-channel packed codes (what a pack-quantized W8A16 file holds) are int8 W8A16
    weights: fbgemm's module, the same logits as the reference path."""
    from tiny import save_tiny

    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    base = save_tiny(tmp_path / "base")
    stage = {"type": "quantize", "method": "rtn", "bits": 8, "group_size": -1, "format": "compressed-tensors"}
    recipe = recipe_from_stage(str(base), stage, {"data": str(text_file), "samples": 2, "seq_len": 64}, "test")
    run_recipe(recipe, tmp_path / "w8", RunOptions(device=CPU, stream=False), loaded=load_model(str(base)))
    loaded = load_model(str(tmp_path / "w8"))
    x = torch.randint(0, 300, (1, 32))
    with torch.no_grad():
        ref = loaded.model(x).logits
        choice = use_fast_kernels(loaded.model, CPU)
        fast = loaded.model(x).logits
    assert choice.kernel == "fbgemm-fp16-codes" and choice.activation_dtype == "float32" and choice.timed
    assert choice.modules == {"fbgemm-fp16-codes": 14}
    assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
