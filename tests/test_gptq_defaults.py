"""GPTQ with the flags a user gets by default (GPTQStage's defaults) against round-to-nearest, and the
first-token (attention-sink) weighting of the Hessian that the defaults use (docs/gptq.md, "Defaults, and why")."""

import pytest
import torch

from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.core.grid import QuantSpec, rtn_quantize

B, T, D = 8, 256, 64  # windows, tokens per window, input columns


def _windows_with_a_sink(seed: int = 0) -> torch.Tensor:
    """(B, T, D) inputs shaped like a decoder's: strongly anisotropic (variances spread over four decades),
    outlier columns, and a first token that is nearly the same vector in every window and points in a
    direction of its own (as the attention sink's representation does)."""
    gen = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(D, D, generator=gen))
    x = (torch.randn(B, T, D, generator=gen) * torch.logspace(0, -2, D)) @ rotation.T * 8**0.5
    x[..., :4] *= 4.0  # outlier input channels
    x[:, 0] = 0.3 * torch.randn(D, generator=gen) + 0.01 * torch.randn(B, D, generator=gen)
    return x


def _q41_weight(out: int = 32, seed: int = 1) -> torch.Tensor:
    """Weights already on an asymmetric 4-bit grid per block of 32 (Q4_1), like the demo model's."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, D, generator=gen)
    blocks = w.view(out, D // 32, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    return (lo + torch.round((blocks - lo) / step) * step).view(out, D)


def _solve(W: torch.Tensor, x: torch.Tensor, cfg: GPTQStage) -> torch.Tensor:
    acc = HessianAccumulator(D, first_token_weight=cfg.first_token_weight)
    acc.add_batch(x)
    spec = QuantSpec(cfg.bits, cfg.group_size, cfg.sym)
    qw, _ = gptq_quantize(W, acc.H, spec, damp=cfg.damp, block_size=cfg.block_size, act_order=cfg.act_order)
    return qw.dequantize()


def _errors(x: torch.Tensor, W: torch.Tensor, Wq: torch.Tensor) -> tuple[float, float]:
    """Relative output error over every token, and at the first tokens only."""
    ref, err = x @ W.T, x @ (Wq - W).T  # (B, T, out)
    return float(err.square().sum() / ref.square().sum()), float(err[:, 0].square().sum() / ref[:, 0].square().sum())


@pytest.mark.parametrize("bits,group", [(4, 16), (4, -1), (3, 16)])
def test_default_gptq_beats_rtn_on_every_token_and_keeps_the_sink_near_rtn(bits, group):
    """Overall far below round-to-nearest; at the sink within 1.5x of it and at most a third of what the
    unweighted Hessian leaves there. (On this synthetic, with the full-range symmetric grid, RTN's sink error
    at 4-bit g16 is 0.73x the default GPTQ's; on the demo model the per-layer check measures it:
    benchmarks/studies/gptq/gptq_layer_check.py.)"""
    x, W = _windows_with_a_sink(), _q41_weight()
    cfg = GPTQStage(method="gptq", bits=bits, group_size=group)
    gptq_all, gptq_sink = _errors(x, W, _solve(W, x, cfg))
    _, unweighted_sink = _errors(x, W, _solve(W, x, cfg.model_copy(update={"first_token_weight": 1.0})))
    rtn_all, rtn_sink = _errors(x, W, rtn_quantize(W, QuantSpec(bits, group, cfg.sym)).dequantize())
    assert gptq_all < 0.2 * rtn_all
    assert gptq_sink <= 1.5 * rtn_sink
    assert gptq_sink <= unweighted_sink / 3


def test_unweighted_hessian_lets_gptq_put_its_error_on_the_sink():
    """The failure the defaults fix: with every token weighted alike (the former default), GPTQ wins on all
    tokens together but moves error onto the first token, where round-to-nearest's is far smaller."""
    x, W = _windows_with_a_sink(), _q41_weight()
    cfg = GPTQStage(method="gptq", bits=4, group_size=16, act_order="none", first_token_weight=1.0)
    gptq_all, gptq_sink = _errors(x, W, _solve(W, x, cfg))
    rtn_all, rtn_sink = _errors(x, W, rtn_quantize(W, QuantSpec(4, 16)).dequantize())
    assert gptq_all < rtn_all
    assert gptq_sink > 2 * rtn_sink


def test_first_token_weight_counts_the_first_position_w_times():
    x = torch.randn(3, 10, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    acc = HessianAccumulator(12, first_token_weight=5.0)
    acc.add_batch(x[:2].float())
    acc.add_batch(x[2:].float())
    c = torch.ones(3, 10, 1, dtype=torch.float64)
    c[:, 0] = 5.0
    flat, cw = x.reshape(-1, 12), c.reshape(-1, 1)
    torch.testing.assert_close(acc.H.double(), 2 * (flat * cw).T @ flat / 30, rtol=1e-5, atol=1e-6)
    assert acc.tokens == 30
    with pytest.raises(ValueError, match="windows"):
        acc.add_batch(torch.randn(10, 12))
