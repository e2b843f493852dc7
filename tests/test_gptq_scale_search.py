"""GPTQ's scale choice for symmetric groups (compress/scale_search.ScaleSearch, search_qparams), 5-bit GPTQ,
and the stage's `scale_search`/`signed_scales` options, on tiny tensors."""

import pytest
import torch

from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.compress.gptq.stage import scale_search
from geminicompress.compress.scale_search import ScaleSearch, importance_for, search_qparams
from geminicompress.core.grid import QuantSpec, fake_quantize, qparams
from geminicompress.core.errors import InputError
from geminicompress.formats import check_shapes


def _err(w, s, z, spec, c=None):
    e = (w - fake_quantize(w, s, z, spec.maxq)).square()
    return (e if c is None else e * c).sum(dim=1)


def test_signed_scale_puts_the_largest_weight_on_the_lowest_code_exactly():
    """Q4_0's grid: scale = w_max / -8. A row whose largest |w| is positive gets a negative scale, and that
    weight dequantizes exactly (code 0); the full-range scale max/7 leaves a coarser step."""
    spec = QuantSpec(4, 32)
    w = torch.tensor([[1.0, 0.5, -0.25, 0.125], [-2.0, 0.75, 0.5, -0.25]])
    s, z = search_qparams(w, spec, ScaleSearch(signed=True))
    assert torch.equal(s, torch.tensor([[-0.125], [0.25]])) and torch.equal(z, torch.full((2, 1), 8.0))
    assert torch.equal(fake_quantize(w, s, z, spec.maxq), w)  # every weight is on that grid: no error
    s0, z0 = qparams(w, spec)
    assert s0[0, 0] == pytest.approx(1 / 7) and _err(w, s0, z0, spec)[0] > 0


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("bits", [4, 5])
def test_weighted_search_never_does_worse_than_its_base_scale_on_its_own_error(signed, bits):
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(64, 32, generator=gen) ** 3  # heavy tails: clipping pays
    hdiag = torch.rand(32, generator=gen) ** 4
    spec = QuantSpec(bits, 32)
    sigma2 = w.square().mean(dim=1, keepdim=True)
    base, z0 = search_qparams(w, spec, ScaleSearch(signed=signed))
    for weights in ("plain", "hdiag", "llama"):
        c = importance_for(weights, hdiag, w, sigma2)
        s, z = search_qparams(w, spec, ScaleSearch(signed=signed, weights=weights), c)
        assert torch.all(_err(w, s, z, spec, c) <= _err(w, base, z0, spec, c) * (1 + 1e-6))
    c = importance_for("hdiag", hdiag, w, sigma2)
    s_plain, _ = search_qparams(w, spec, ScaleSearch(signed=signed, weights="plain", refit=False))
    s_w, _ = search_qparams(w, spec, ScaleSearch(signed=signed, weights="hdiag", refit=False), c)
    # over the same candidates the weighted search is best under its weights, row by row, and better overall
    assert torch.all(_err(w, s_w, z0, spec, c) <= _err(w, s_plain, z0, spec, c) * (1 + 1e-6))
    assert _err(w, s_w, z0, spec, c).sum() < _err(w, s_plain, z0, spec, c).sum()


def test_signed_scales_lower_the_rounding_error_against_the_full_range():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 32, generator=gen)
    spec = QuantSpec(4, 32)
    s0, z0 = qparams(w, spec)
    s, z = search_qparams(w, spec, ScaleSearch(signed=True))
    assert _err(w, s, z, spec).sum() < 0.9 * _err(w, s0, z0, spec).sum()


def _layer(seed=0, out_f=24, in_f=64, n=512):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_f, generator=gen) * (torch.rand(in_f, generator=gen) * 3) ** 2  # uneven inputs
    W = torch.randn(out_f, in_f, generator=gen) ** 3
    return W, 2 * x.t() @ x / n


def _output_error(W, qw, H):
    d = W - qw.dequantize()
    return float(((d @ H) * d).sum())


@pytest.mark.parametrize("act_order", ["none", "static"])
def test_gptq_with_signed_weighted_search_lowers_the_layer_error(act_order):
    W, H = _layer()
    spec = QuantSpec(4, 32)
    errs = {}
    for name, search in {"range": None, "signed": ScaleSearch(signed=True),
                         "signed+weighted": ScaleSearch(signed=True, weights="llama")}.items():
        qw, _ = gptq_quantize(W, H, spec, act_order=act_order, search=search)
        errs[name] = _output_error(W, qw, H)
    assert errs["signed"] < errs["range"]
    assert errs["signed+weighted"] < errs["signed"]


def test_gptq_search_upfront_and_lazy_both_run_and_differ():
    W, H = _layer(1)
    spec = QuantSpec(4, 32)
    search = ScaleSearch(signed=True, weights="hdiag")
    a, _ = gptq_quantize(W, H, spec, act_order="static", search=search)
    b, _ = gptq_quantize(W, H, spec, act_order="static", search=search, group_params="upfront")
    assert not torch.equal(a.scales, b.scales)  # the lazy choice sees the error feedback


def test_gptq_five_bits():
    W, H = _layer(2)
    errs = {b: _output_error(W, gptq_quantize(W, H, QuantSpec(b, 32))[0], H) for b in (4, 5)}
    qw, _ = gptq_quantize(W, H, QuantSpec(5, 32))
    assert int(qw.q.max()) <= 31 and int(qw.zeros[0, 0]) == 16
    assert errs[5] < 0.4 * errs[4]


def test_five_bits_are_refused_by_the_packed_formats_and_taken_by_dense():
    spec = QuantSpec(5, 32)
    for fmt in ("gptq", "compressed-tensors"):
        with pytest.raises(InputError, match="gguf"):
            check_shapes(fmt, {"x": (64, 64)}, spec)
    check_shapes("dense", {"x": (64, 64)}, spec)
    assert GPTQStage(method="gptq", bits=5).bits == 5
    with pytest.raises(ValueError):
        GPTQStage(method="awq" if False else "gptq", bits=6)


def test_auto_is_off_for_the_normal_formats_and_signed_weighted_for_gguf():
    spec = QuantSpec(4, 32)
    assert scale_search(GPTQStage(method="gptq"), spec) is None  # today's bytes
    assert scale_search(GPTQStage(method="gptq", format="dense"), spec) is None
    gguf = GPTQStage.model_construct(**{**GPTQStage(method="gptq").model_dump(), "format": "gguf"})
    assert scale_search(gguf, spec) == ScaleSearch(signed=True, weights="llama", trial=True, lo=0.3, hi=1.6, grid=130)
    assert scale_search(GPTQStage(method="gptq", scale_search="plain"), spec) == ScaleSearch(weights="plain")
    assert scale_search(GPTQStage(method="gptq", signed_scales=True), spec) == ScaleSearch(signed=True)
    off = GPTQStage.model_construct(**{**gguf.model_dump(), "scale_search": "none", "signed_scales": False})
    assert scale_search(off, spec) is None
    with pytest.raises(ValueError, match="symmetric"):
        GPTQStage(method="gptq", sym=False, scale_search="weighted")


def test_hinv_weights_run_lazily_and_refuse_upfront():
    W, H = _layer(3)
    spec = QuantSpec(4, 32)
    qw, _ = gptq_quantize(W, H, spec, act_order="static", search=ScaleSearch(signed=True, weights="hinv"))
    base, _ = gptq_quantize(W, H, spec, act_order="static", search=ScaleSearch(signed=True))
    assert _output_error(W, qw, H) < _output_error(W, base, H)
    with pytest.raises(Exception, match="reaches it"):
        gptq_quantize(W, H, spec, search=ScaleSearch(weights="hinv"), group_params="upfront")


@pytest.mark.parametrize("act_order,order", [("static", "gar"), ("static", "local"), ("none", "global")])
def test_trial_search_lowers_gptqs_loss_where_groups_are_solved_contiguously(act_order, order):
    W, H = _layer(4, out_f=40, in_f=128)
    spec = QuantSpec(4, 32)
    base = ScaleSearch(signed=True, weights="llama")
    plain, loss_plain = gptq_quantize(W, H, spec, act_order=act_order, order=order, search=base)
    trial, loss_trial = gptq_quantize(W, H, spec, act_order=act_order, order=order,
                                      search=ScaleSearch(signed=True, weights="llama", trial=True))
    assert loss_trial < 0.99 * loss_plain
    assert _output_error(W, trial, H) < _output_error(W, plain, H)
    assert not torch.equal(trial.scales, plain.scales)


def test_trial_search_leaves_scattered_groups_to_the_weighted_search():
    W, H = _layer(5)
    spec = QuantSpec(4, 32)
    a, _ = gptq_quantize(W, H, spec, act_order="static", search=ScaleSearch(signed=True, weights="llama"))
    b, _ = gptq_quantize(W, H, spec, act_order="static", search=ScaleSearch(signed=True, weights="llama", trial=True))
    assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales)  # global act order: groups are scattered


@pytest.mark.parametrize("bits,qtype", [(4, "Q4_0"), (5, "Q5_0")])
def test_trial_searched_codes_are_exact_in_gguf(bits, qtype):
    from gguf import quants

    from geminicompress.formats import gguf as blocks

    W, H = _layer(6, out_f=16, in_f=96)
    qw, _ = gptq_quantize(W, H, QuantSpec(bits, 32), act_order="static", order="gar",
                          search=ScaleSearch(signed=True, weights="llama", trial=True))
    qw.scales = qw.scales.half().float()  # what a GGUF block holds
    assert (qw.scales < 0).any()  # signed scales: the largest weight on the lowest code
    enc = blocks.encode_quantized(qw)
    assert enc.qtype.name == qtype and enc.max_step_error == 0.0
    assert torch.equal(torch.from_numpy(quants.dequantize(enc.data, enc.qtype)), qw.dequantize())


def test_trial_choice_solves_groups_in_group_aware_order():
    from geminicompress.compress.gptq.stage import solver_options

    spec = QuantSpec(4, 32)
    opts = solver_options(GPTQStage(method="gptq", scale_search="trial", signed_scales=True), spec)
    assert opts.search == ScaleSearch(signed=True, weights="llama", trial=True, lo=0.3, hi=1.6, grid=130)
    assert opts.order == "gar"
    assert solver_options(GPTQStage(method="gptq"), spec).order == "global"  # other formats: bytes unchanged
    assert solver_options(GPTQStage(method="gptq", scale_search="trial", act_order="none"), spec).order == "global"
