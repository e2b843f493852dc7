"""Least-squares refit of group scales with the codes fixed (benchmarks/studies/gptq/refit.py: a study, out of
the package; loaded from its file so that benchmarks/ stays off the test run's sys.path)."""

import importlib.util
from pathlib import Path

import torch

from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.core.grid import QuantizedWeight, QuantSpec, group_index

_REFIT = Path(__file__).resolve().parents[1] / "benchmarks" / "studies" / "gptq" / "refit.py"
_spec = importlib.util.spec_from_file_location("gptq_refit_study", _REFIT)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
refit_scales = _module.refit_scales


def _hessian(d: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(512, d, generator=gen) @ torch.randn(d, d, generator=gen) / d**0.5
    return 2 * X.T @ X / 512


def _error(W, Wq, H) -> torch.Tensor:
    d = Wq - W
    return ((d @ H) * d).sum(dim=1)


def test_refit_recovers_the_scales_a_weight_was_made_with():
    gen = torch.Generator().manual_seed(1)
    spec = QuantSpec(4, 8, sym=True)
    q = torch.randint(0, 16, (6, 32), generator=gen, dtype=torch.int32)
    scales = torch.rand(6, 4, generator=gen) + 0.5
    zeros = torch.full((6, 4), 8, dtype=torch.int32)
    exact = QuantizedWeight(q, scales, zeros, group_index(32, spec), spec)
    W = exact.dequantize()
    off = QuantizedWeight(q, scales * 1.3, zeros, exact.g_idx, spec)
    torch.testing.assert_close(refit_scales(off, W, _hessian()).scales, scales, rtol=1e-4, atol=1e-5)


def test_refit_lowers_every_rows_output_error_after_gptq_and_keeps_the_codes():
    H = _hessian(seed=2)
    W = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    for spec, act_order in ((QuantSpec(3, 8, sym=True), "static"), (QuantSpec(4, 8, sym=False), "group"),
                            (QuantSpec(4, -1, sym=True), "none")):
        qw, _ = gptq_quantize(W, H, spec, act_order=act_order)
        fit = refit_scales(qw, W, H)
        assert torch.equal(fit.q, qw.q) and torch.equal(fit.zeros, qw.zeros) and torch.equal(fit.g_idx, qw.g_idx)
        before, after = _error(W, qw.dequantize(), H), _error(W, fit.dequantize(), H)
        assert torch.all(after <= before + 1e-6) and float(after.sum()) < float(before.sum())
        assert torch.all(fit.scales > 0)
