"""INT8 math, modules and SmoothQuant folding on small tensors with known answers."""

import pytest
import torch
import torch.nn as nn

from geminicompress.compress.fold import fold_scales
from geminicompress.compress.int8 import smoothquant as sq
from geminicompress.kernels.int8 import Int8WeightOnlyLinear, W8A8Linear, fbgemm_available
from geminicompress.kernels.int8_quant import (
    channel_scales,
    dequantize,
    fake_quantize_tokens,
    quantize,
    quantize_weight,
)


def test_channel_scales_and_codes_known_answer():
    w = torch.tensor([[0.3, -1.27, 0.127], [0.0, 0.0, 0.0], [2.54, 0.0, -1.0]])
    scale = channel_scales(w)
    assert torch.allclose(scale, torch.tensor([[0.01], [1.0], [0.02]]))
    q = quantize(w, scale)
    assert q.dtype == torch.int8
    assert q.tolist() == [[30, -127, 13], [0, 0, 0], [127, 0, -50]]
    assert torch.allclose(dequantize(q, scale), torch.tensor([[0.3, -1.27, 0.13], [0, 0, 0], [2.54, 0.0, -1.0]]))


def test_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows of very different magnitude
    q, scale = quantize_weight(w)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    assert (q.abs().amax(dim=1) == 127).all()  # every row uses the full grid
    err = (w - dequantize(q, scale)).abs()
    assert (err <= scale / 2 + 1e-7 * w.abs()).all()


def test_token_fake_quant_is_per_row():
    x = torch.tensor([[1000.0, 1.0, -500.0], [0.01, -0.02, 0.005]])
    y = fake_quantize_tokens(x)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((x - y).abs() <= step / 2 * (1 + 1e-5)).all()
    assert y[1].abs().min() > 0  # the small row keeps its own resolution


def _bound(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """|x Ŵ^T - y| <= max|x_t| / 254 · Σ_j |Ŵ_ij|: half an 8-bit step per activation, per token."""
    r = x.abs().amax(dim=-1, keepdim=True)
    return r / 254 * module.dequantized_weight().abs().sum(dim=1) * 1.001 + 1e-5


@pytest.mark.parametrize("tokens", [1, 7])
def test_w8a8_matches_int8_math_within_activation_rounding(tokens):
    torch.manual_seed(1)
    linear = nn.Linear(96, 40)
    module = W8A8Linear.from_linear(linear)
    x = torch.randn(tokens, 96)
    x[:, 5] *= 50  # an outlier channel
    exact = nn.functional.linear(x, module.dequantized_weight(), linear.bias)  # weights int8, activations float
    for y in (module(x), module.reference_forward(x)):
        assert y.shape == (tokens, 40)
        assert ((y - exact).abs() <= _bound(module, x)).all()


def test_w8a8_uses_fbgemm_on_cpu_and_keeps_batch_shape():
    module = W8A8Linear.from_linear(nn.Linear(32, 16, bias=False))
    assert module.kernel == ("fbgemm-dynamic" if fbgemm_available() else "reference")
    assert module(torch.randn(2, 3, 32)).shape == (2, 3, 16)


def test_weight_only_linear_is_exact_given_int8_weights():
    torch.manual_seed(2)
    linear = nn.Linear(48, 24)
    module = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(2, 5, 48)
    exact = nn.functional.linear(x, module.dequantized_weight(), linear.bias)
    assert torch.allclose(module(x), exact, atol=1e-5)
    state = module.state_dict()
    assert state["weight"].dtype == torch.int8 and state["weight_scale"].shape == (24, 1)


def test_w8a8_repacks_after_loading_new_weights():
    a = W8A8Linear.from_linear(nn.Linear(16, 8, bias=False))
    b = W8A8Linear.from_linear(nn.Linear(16, 8, bias=False))
    x = torch.randn(3, 16)
    a(x)  # packs a's weight
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), b(x))


def test_smooth_scales_known_answer():
    s = sq.smooth_scales(torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0]), alpha=0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))
    assert torch.allclose(sq.smooth_scales(torch.tensor([8.0]), torch.tensor([2.0]), alpha=1.0), torch.tensor([8.0]))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_folding_leaves_the_float_model_unchanged(kind):
    from tiny import tiny_model

    model = tiny_model(kind)
    ids = torch.randint(0, 384, (1, 24))
    before = model(ids).logits
    from geminicompress.core.arch import arch_for, get_module

    arch = arch_for(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    groups, skipped = sq.foldable_groups(model, arch, linears)
    assert len(groups) == 2 * 3 and len(skipped) == 2  # v_proj -> o_proj differs in width under GQA
    torch.manual_seed(0)
    with torch.no_grad():
        for g in groups:
            lins = [get_module(model, n) for n in g.linears]
            fold_scales(get_module(model, g.prev), lins, torch.rand(lins[0].in_features) * 4 + 0.25, arch.norm_offset)
    assert torch.allclose(model(ids).logits, before, atol=1e-4)


def test_smoothquant_statistic_is_window_maxima_averaged_per_channel(tmp_path):
    """The w8a8 stage smooths down_proj with s from the mean over the windows of each window's max |x| per
    channel, taken on the float layer's inputs (not the max over all tokens, which grows with the text)."""
    from tiny import tiny_model, tiny_tokenizer

    from geminicompress.compress.int8.config import Int8Stage
    from geminicompress.engine.contract import StageContext
    from geminicompress.host.progress import NullProgress
    from geminicompress.runtime.recipes.schema import Recipe
    from geminicompress.runtime.stages import run_stage

    model, copy = tiny_model(), tiny_model()
    windows = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    handle = copy.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        for w in windows:  # the float model, one window at a time
            copy(w.unsqueeze(0))
    handle.remove()
    mean_max = torch.stack([s.reshape(-1, s.shape[-1]).abs().amax(dim=0) for s in seen]).mean(dim=0)
    expected = sq.smooth_scales(mean_max, sq.weight_column_max([copy.model.layers[1].mlp.down_proj]), 0.5)
    overall = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen]).abs().amax(dim=0)
    assert (mean_max < overall - 1e-6).any()  # the two statistics differ here
    ctx = StageContext(model, tiny_tokenizer(), None, Recipe(model="tiny", stages=[{"type": "quantize", "method": "w8a8"}]),
                       NullProgress(), torch.device("cpu"), tmp_path, tmp_path)
    ctx.calibration = lambda data=None, samples=None, seq_len=None: windows
    summary = run_stage(Int8Stage(method="w8a8"), ctx)[1]
    row = next(r for r in summary["layers"] if r["name"] == "model.layers.1.mlp.down_proj")
    assert row["smoothquant_max_scale"] == round(float(expected.max()), 4)


def test_blocks_of_rows_give_the_whole_tensors_codes_and_error():
    """quantize_weight and relative_error a few rows at a time (a big output head is never made float32 whole):
    the same codes and scales as the whole tensor at once, bfloat16 and float32 weights, with and without a
    given scale; the error that of the dequantized tensor."""
    from geminicompress.kernels.int8_quant import channel_scales, quantize, relative_error

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(103, 40) * torch.logspace(-3, 1, 103).unsqueeze(1)).to(dtype)
        w[5] = 0  # an all-zero row keeps scale 1
        scale = channel_scales(w)
        whole = quantize(w, scale)
        for block in (4 * 40 * 7, 4 * 40, 1 << 20):  # 7 rows, 1 row, everything in one block
            q, s = quantize_weight(w, block_bytes=block)
            assert torch.equal(q, whole) and torch.equal(s, scale)
            given = (scale * 1.5).to(torch.float16).float()
            assert torch.equal(quantize_weight(w, given, block_bytes=block)[0], quantize(w, given))
            half = scale.to(torch.float16).float()  # GGUF's Q8_0: codes chosen on the scales it stores
            assert all(torch.equal(a, b) for a, b in zip(
                quantize_weight(w, block_bytes=block, scale_dtype=torch.float16), (quantize(w, half), half)))
            want = float((w.float() - dequantize(whole, scale)).norm() / w.float().norm())
            assert relative_error(w, q, s, block_bytes=block) == pytest.approx(want, rel=1e-5)


def test_a_weight_packed_by_blocks_of_rows_computes_what_one_pack_does(monkeypatch):
    """A big INT8 weight (an output head) is packed a block of float32 rows at a time, never whole: W8A16's
    fp16 packs and W8A8's row sums give the same numbers as one pack of the whole weight."""
    import geminicompress.kernels.int8 as int8

    torch.manual_seed(3)
    linear = nn.Linear(40, 103, bias=True)
    x = torch.randn(2, 5, 40)
    for cls in (Int8WeightOnlyLinear, W8A8Linear):
        whole = cls.from_linear(linear)
        want = whole(x)
        sums = getattr(whole, "_sums", None)
        for rows in (7, 1, 103):
            monkeypatch.setattr(int8, "PACK_BYTES", 4 * 40 * rows)
            module = cls.from_linear(linear)
            assert torch.equal(module(x), want)
            if cls is Int8WeightOnlyLinear and fbgemm_available():
                assert len(module._packed) == -(-103 // rows)  # packs of `rows` rows each
                assert torch.equal(module(x[0, :1]), whole(x[0, :1]))  # one token
            if sums is not None:
                assert torch.equal(module._sums, sums)
        monkeypatch.undo()
