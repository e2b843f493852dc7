"""The clipping search of a group's range (compress/scale_search.py) on small tensors."""

import pytest
import torch

from geminicompress.compress.scale_search import clip_qparams
from geminicompress.core.grid import QuantSpec, fake_quantize, qparams


def _err(w, scale, zero, spec, importance=None, norm=2.0):
    e = (w - fake_quantize(w, scale, zero, spec.maxq)).abs().pow(norm)
    return (e if importance is None else e * importance).sum(dim=1)


def test_no_grid_is_the_min_max_range():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    for sym in (True, False):
        spec = QuantSpec(4, sym=sym)
        s0, z0 = qparams(w, spec)
        s, z = clip_qparams(w, spec, grid=0)
        assert torch.equal(s, s0) and torch.equal(z, z0)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [3, 4])
def test_search_never_does_worse_than_min_max_on_its_own_error(sym, bits):
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(32, 64, generator=gen) * torch.rand(32, 1, generator=gen)
    imp = torch.rand(64, generator=gen)
    spec = QuantSpec(bits, sym=sym)
    s0, z0 = qparams(w, spec)
    for importance in (None, imp):
        s, z = clip_qparams(w, spec, importance, grid=20, maxshrink=0.3)
        assert torch.all(_err(w, s, z, spec, importance) <= _err(w, s0, z0, spec, importance) + 1e-6)
        assert torch.all(s <= s0 + 1e-7)  # only shrinks


def test_an_outlier_is_clipped_when_it_costs_less_than_a_coarse_step_for_everyone():
    """255 weights in [-1, 1] and one of 1.5: the full range's step is 1.5/7; shrinking it by 20% clips the
    outlier by 0.3 (error 0.09) and saves 36% of the rounding error of the others (~0.35). Made important
    enough, the outlier keeps its range."""
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(1, 256, generator=gen) * 2 - 1
    w[0, 5] = 1.5
    spec = QuantSpec(4, sym=True)
    s0, _ = qparams(w, spec)
    s, _ = clip_qparams(w, spec, grid=50, maxshrink=0.5)
    assert float(s) < 0.95 * float(s0)
    imp = torch.ones(256)
    imp[5] = 1e4
    s_imp, _ = clip_qparams(w, spec, imp, grid=50, maxshrink=0.5)
    assert float(s_imp) == pytest.approx(float(s0))
