"""Quantization grid math on small tensors with known answers."""

import pytest
import torch

from geminicompress.core.grid import QuantSpec, qparams, rtn_quantize
from geminicompress.core.errors import InputError


def test_asym_known_answer():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    scale, zero = qparams(w, QuantSpec(bits=2, sym=False))
    assert scale.item() == pytest.approx(1.0) and zero.item() == 0
    qw = rtn_quantize(w, QuantSpec(bits=2, sym=False))
    assert qw.q.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(qw.dequantize(), w)


def test_sym_known_answer():
    w = torch.tensor([[-4.0, 2.0, 0.0, 4.0]])
    scale, zero = qparams(w, QuantSpec(bits=4, sym=True))
    assert scale.item() == pytest.approx(4.0 / 7) and zero.item() == 8  # +4 needs 7 steps above zero
    qw = rtn_quantize(w, QuantSpec(bits=4, sym=True))
    assert qw.q[0, 2] == 8  # zero maps to the zero point exactly
    assert qw.q.tolist() == [[1, 11, 8, 15]]
    # GPTQ's / compressed-tensors' absmax grid: step 8/15, so +4 is clipped to 7 steps = 3.73
    scale, _ = qparams(w, QuantSpec(bits=4, sym=True), sym_range="absmax")
    assert scale.item() == pytest.approx(8.0 / 15)


def test_sym_grid_uses_the_extra_negative_step_and_never_clips():
    """Codes − zero run from −8 to 7 at 4 bits: a row whose largest magnitude is negative gets step max/8
    (finer than 2·max/15), one whose largest is positive step max/7; both ends are on the grid."""
    neg = torch.tensor([[-8.0, 1.0, 3.0, 7.0]])
    scale, zero = qparams(neg, QuantSpec(bits=4, sym=True))
    assert scale.item() == pytest.approx(1.0)
    qw = rtn_quantize(neg, QuantSpec(bits=4, sym=True))
    assert qw.q.tolist() == [[0, 9, 11, 15]] and torch.equal(qw.dequantize(), neg)
    for bits in (2, 3, 4, 8):
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(bits))
        qw = rtn_quantize(w, QuantSpec(bits, 8, sym=True))
        step = qw.scales[:, qw.g_idx.long()]
        assert torch.all((qw.dequantize() - w).abs() <= step / 2 + 1e-6)  # nothing clipped
        # the most negative weight of every group lands on code 0 or the largest on code 2^b − 1
        lo = (qw.q.view(64, -1, 8).amin(-1) == 0) | (qw.q.view(64, -1, 8).amax(-1) == 2**bits - 1)
        assert bool(lo.all())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 4])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_within_half_step(bits, group_size, sym):
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    qw = rtn_quantize(w, QuantSpec(bits, group_size, sym))
    assert qw.q.min() >= 0 and qw.q.max() <= 2**bits - 1
    err = (qw.dequantize() - w).abs()
    step = qw.scales[:, qw.g_idx.long()]
    assert torch.all(err <= step / 2 + 1e-6)
    assert qw.scales.shape == (8, 1 if group_size == -1 else 4)


def test_bad_spec():
    with pytest.raises(InputError, match="bits must be"):
        QuantSpec(bits=6)
    assert QuantSpec(bits=4, group_size=0).group_size == -1


def test_hessian_accumulator_matches_direct_formula():
    from geminicompress.compress.hessian import HessianAccumulator

    torch.manual_seed(0)
    xs = [torch.randn(1, 5, 6), torch.randn(1, 7, 6)]
    acc = HessianAccumulator(6)
    for x in xs:
        acc.add_batch(x)
    X = torch.cat([x.reshape(-1, 6) for x in xs])
    torch.testing.assert_close(acc.H, 2 * X.t() @ X / X.shape[0])
    assert acc.tokens == 12
