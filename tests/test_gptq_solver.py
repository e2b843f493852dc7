"""The GPTQ solver on small layers with known answers."""

import pytest
import torch

from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.core.errors import GeminiError

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _correlated(n: int = 1024, d: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen) / d**0.5
    return torch.randn(n, d, generator=gen) @ mix + 0.05 * torch.randn(n, d, generator=gen)  # (n, d)


def _hessian(X: torch.Tensor) -> torch.Tensor:
    return 2 * X.T @ X / X.shape[0]


def _output_error(X, W, Wq) -> float:
    return float(((X @ (W - Wq).T) ** 2).sum())


@pytest.mark.parametrize("bits,group,act_order,sym", [(4, -1, False, True), (4, 16, False, True), (3, 16, True, False),
                                                      (2, 32, True, True), (4, 16, True, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, group, act_order, sym):
    X = _correlated()
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(bits, group, sym)
    qw, loss = gptq_quantize(W, _hessian(X), spec, act_order=act_order, block_size=24)
    rtn = rtn_quantize(W, spec)
    assert _output_error(X, W, qw.dequantize()) < 0.8 * _output_error(X, W, rtn.dequantize())
    assert loss > 0
    assert int(qw.q.min()) >= 0 and int(qw.q.max()) <= spec.maxq
    assert qw.scales.shape == (16, spec.groups(64)) and qw.zeros.shape == qw.scales.shape


def test_identity_hessian_reduces_to_round_to_nearest():
    """With H = I no column's error can be compensated by another: GPTQ is RTN, code for code."""
    W = torch.randn(8, 48, generator=torch.Generator().manual_seed(2))
    for spec in (QuantSpec(4, -1), QuantSpec(3, 16, sym=False)):
        qw, _ = gptq_quantize(W, torch.eye(48), spec, block_size=20)
        rtn = rtn_quantize(W, spec)
        assert torch.equal(qw.q, rtn.q) and torch.equal(qw.zeros, rtn.zeros)
        torch.testing.assert_close(qw.scales, rtn.scales)


def test_eight_bit_is_nearly_exact():
    X = _correlated()
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    qw, _ = gptq_quantize(W, _hessian(X), QuantSpec(8, -1))
    rel = _output_error(X, W, qw.dequantize()) / float(((X @ W.T) ** 2).sum())
    assert rel < 1e-4


def test_act_order_g_idx_is_in_original_order_and_static_groups_keep_it_monotone():
    X = _correlated() * torch.linspace(0.1, 3.0, 64)  # distinct diagonal: act-order permutes
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    H = _hessian(X)
    qw, _ = gptq_quantize(W, H, QuantSpec(4, 16), act_order=True)
    # the 16 columns with the largest H_jj are quantized first and form group 0
    first = torch.argsort(torch.diag(H), descending=True)[:16]
    assert set(torch.nonzero(qw.g_idx == 0).flatten().tolist()) == set(first.tolist())
    static, _ = gptq_quantize(W, H, QuantSpec(4, 16), act_order=True, static_groups=True)
    assert torch.equal(static.g_idx, torch.arange(64, dtype=torch.int32) // 16)
    # the codes are stored in the original column order: dequantize() must approximate W itself
    for result in (qw, static):
        assert _output_error(X, W, result.dequantize()) < _output_error(X, W, rtn_quantize(W, QuantSpec(4, 16)).dequantize())


def test_dead_inputs_get_zero_weight():
    X = _correlated()
    X[:, 5] = 0.0
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    qw, _ = gptq_quantize(W, _hessian(X), QuantSpec(4, -1))
    assert torch.all(qw.dequantize()[:, 5] == 0)


def test_nan_or_inf_is_one_clear_error():
    W = torch.randn(4, 8)
    H = torch.eye(8)
    H[2, 3] = float("nan")
    with pytest.raises(GeminiError, match="Hessian holds NaN/Inf"):
        gptq_quantize(W, H, QuantSpec(4, -1))
    W[0, 0] = float("inf")
    with pytest.raises(GeminiError, match="weight holds NaN/Inf"):
        gptq_quantize(W, torch.eye(8), QuantSpec(4, -1))


def test_block_size_does_not_change_the_result():
    """Lazy batching is exact: any block size (also one that cuts groups in two) gives the same codes."""
    X = _correlated()
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    H = _hessian(X)
    spec = QuantSpec(3, 16, sym=False)
    ref, loss_ref = gptq_quantize(W, H, spec, block_size=64)
    for block in (1, 10, 24):
        qw, loss = gptq_quantize(W, H, spec, block_size=block)
        assert (qw.q == ref.q).float().mean() > 0.99
        assert abs(loss - loss_ref) < 1e-3 * loss_ref


def _textbook_gptq(W, H, spec, damp=0.01, act_order=False, static_groups=False, keep_zero=None, upfront=False):
    """Algorithm 1 of the paper without any batching: quantize column j, update every later column at once.
    Static groups (g_idx = j // group): a group's scale is decided from the group's current (updated) columns
    when its first column is reached, or from the unquantized weights with `upfront`."""
    from geminicompress.core.grid import qparams, quantize

    W, H = W.clone().double(), H.clone().double()
    in_f = W.shape[1]
    gs = in_f if spec.group_size == -1 else spec.group_size
    fixed = static_groups or spec.group_size == -1
    params = {g // gs: qparams(W[:, g:g + gs].float(), spec) for g in range(0, in_f, gs)} if upfront else {}
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f)
    W, H = W[:, perm], H[perm][:, perm]
    mask = None if keep_zero is None else keep_zero[:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(in_f, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    group = perm // gs if fixed else torch.arange(in_f) // gs
    for j in range(in_f):
        g = int(group[j])
        if g not in params:  # the group's first column in quantization order
            params[g] = qparams(W[:, group == g].float(), spec)
        scale, zero = params[g]
        s, z = scale[:, 0].double(), zero[:, 0].double()
        Q[:, j] = quantize(W[:, j], s, z, spec.maxq)
        if mask is not None:
            Q[:, j] = torch.where(mask[:, j], z, Q[:, j])
        err = (W[:, j] - s * (Q[:, j] - z)) / U[j, j]
        W[:, j + 1:] -= torch.outer(err, U[j, j + 1:])
    return Q[:, torch.argsort(perm)].to(torch.int32)


@pytest.mark.parametrize("group,act_order,static_groups,block", [(-1, True, False, 128), (16, False, False, 24),
                                                                 (16, True, True, 40), (32, True, False, 20),
                                                                 (48, False, False, 128)])
def test_blocked_solver_equals_the_textbook_algorithm(group, act_order, static_groups, block):
    """Lazy blocks, rank-1 sub-blocks and the transposed layout change only the order of the sums."""
    X = _correlated(d=96)
    W = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    spec = QuantSpec(3, group, sym=False)
    qw, _ = gptq_quantize(W, _hessian(X), spec, block_size=block, act_order=act_order, static_groups=static_groups)
    ref = _textbook_gptq(W, _hessian(X), spec, act_order=act_order, static_groups=static_groups)
    assert (qw.q == ref).float().mean() > 0.995


def test_hessian_accumulator_equals_two_over_n_xtx_over_uneven_batches():
    from geminicompress.compress.hessian import HessianAccumulator

    X = _correlated(n=300, d=12)
    acc = HessianAccumulator(12)
    for lo, hi in ((0, 7), (7, 107), (107, 300)):
        acc.add_batch(X[lo:hi].view(1, hi - lo, 12))
    torch.testing.assert_close(acc.H, 2 * X.T @ X / 300, rtol=1e-5, atol=1e-6)
    assert acc.tokens == 300


@pytest.mark.parametrize("d", [90, 300, 1300])  # 1, 2 and 7 blocks of ~192 columns
def test_blocked_hessian_accumulator_is_symmetric_and_exact_also_when_read_between_batches(d):
    from geminicompress.compress.hessian import HessianAccumulator

    X = torch.randn(500, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    acc = HessianAccumulator(d)
    acc.add_batch(X[:200].float())
    torch.testing.assert_close(acc.H.double(), 2 * X[:200].T @ X[:200] / 200, rtol=1e-4, atol=1e-4)
    acc.add_batch(X[200:].float())
    H = acc.H
    torch.testing.assert_close(H.double(), 2 * X.T @ X / 500, rtol=1e-4, atol=1e-4)
    e = acc._edges
    assert len(e) - 1 == max(1, round(d / 192))
    for a in range(len(e) - 2):  # blocks below the diagonal mirror those above it exactly
        assert torch.equal(H[e[a + 1]:, e[a]:e[a + 1]], H[e[a]:e[a + 1], e[a + 1]:].T)


def _pruned(out_f: int = 24, in_f: int = 96, sparsity: float = 0.5, seed: int = 4) -> torch.Tensor:
    W = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    W[W.abs() < W.abs().flatten().kthvalue(int(sparsity * W.numel())).values] = 0.0
    return W


@pytest.mark.parametrize("group,act_order,sym", [(16, True, False), (32, False, True), (-1, True, True)])
def test_kept_zeros_stay_exactly_zero_and_cost_less_than_zeroing_afterwards(group, act_order, sym):
    """A pruned weight through GPTQ: without the mask the error feedback moves pruned weights off zero;
    with it every one dequantizes to exactly 0, and the output error is lower than re-zeroing them after
    an unmasked solve (their error was spread over the later columns instead of being dropped)."""
    X = _correlated(d=96)
    W = _pruned()
    mask = W == 0
    spec = QuantSpec(4, group, sym=sym)
    free, _ = gptq_quantize(W, _hessian(X), spec, act_order=act_order, block_size=40)
    assert (free.dequantize()[mask] != 0).float().mean() > 0.02  # the problem
    kept, _ = gptq_quantize(W, _hessian(X), spec, act_order=act_order, block_size=40, keep_zero=mask)
    Wq = kept.dequantize()
    assert bool((Wq[mask] == 0).all())
    rezeroed = free.dequantize().masked_fill(mask, 0.0)
    assert _output_error(X, W, Wq) < 0.97 * _output_error(X, W, rezeroed)  # measured 0.92-0.96


@pytest.mark.parametrize("group,act_order,static_groups,block", [(16, True, False, 40), (32, False, False, 24),
                                                                 (16, True, True, 128)])
def test_kept_zeros_follow_the_textbook_algorithm_on_the_numpy_and_the_torch_loop(monkeypatch, group, act_order,
                                                                                 static_groups, block):
    from geminicompress.compress.gptq import solver

    X = _correlated(d=96)
    W = _pruned(seed=5)
    spec = QuantSpec(3, group, sym=False)
    ref = _textbook_gptq(W, _hessian(X), spec, act_order=act_order, static_groups=static_groups, keep_zero=W == 0)
    qw, _ = gptq_quantize(W, _hessian(X), spec, block_size=block, act_order=act_order, static_groups=static_groups,
                          keep_zero=W == 0)
    assert (qw.q == ref).float().mean() > 0.995
    monkeypatch.setattr(solver, "_NUMPY_ON_CPU", False)
    on_torch, _ = gptq_quantize(W, _hessian(X), spec, block_size=block, act_order=act_order,
                                static_groups=static_groups, keep_zero=W == 0)
    assert (on_torch.q == qw.q).float().mean() > 0.995
    assert bool((on_torch.dequantize()[W == 0] == 0).all())


def test_zeros_to_keep_is_the_zero_mask_only_when_asked_and_present():
    from geminicompress.compress.gptq.solver import zeros_to_keep

    dense = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert zeros_to_keep(dense, True, rows=7) is None  # nothing to keep
    dense[40, :3] = 0.0
    assert int(zeros_to_keep(dense, True, rows=7).sum()) == 3
    pruned = _pruned(64, 32)
    assert torch.equal(zeros_to_keep(pruned, True, rows=7), pruned == 0)
    assert zeros_to_keep(pruned, False) is None
    with pytest.raises(GeminiError, match="mask shape"):
        gptq_quantize(pruned, torch.eye(32), QuantSpec(4, 16), keep_zero=torch.zeros(3, 3, dtype=torch.bool))


def test_overwrite_gives_the_same_result_and_frees_the_scratch():
    """overwrite=True: the caller's W and H are used in place and their memory released (left empty)."""
    X = _correlated(d=96)
    W = torch.randn(24, 96, generator=torch.Generator().manual_seed(7))
    spec = QuantSpec(4, 32, sym=False)
    ref, loss = gptq_quantize(W, _hessian(X), spec, act_order=True, block_size=40)
    W2, H2 = W.clone(), _hessian(X)
    qw, loss2 = gptq_quantize(W2, H2, spec, act_order=True, block_size=40, overwrite=True)
    assert torch.equal(qw.q, ref.q) and torch.equal(qw.scales, ref.scales) and loss2 == loss
    assert W2.shape == H2.shape == (0,)


def test_row_blocked_dequantize_equals_the_whole_matrix_formula():
    g = torch.Generator().manual_seed(8)
    spec = QuantSpec(4, 16, sym=False)
    g_idx = torch.randperm(64, generator=g).to(torch.int32) // 16  # act-order: groups out of column order
    from geminicompress.core.grid import QuantizedWeight

    qw = QuantizedWeight(torch.randint(0, 16, (37, 64), generator=g, dtype=torch.int32),
                         torch.rand(37, 4, generator=g), torch.randint(0, 16, (37, 4), generator=g, dtype=torch.int32),
                         g_idx, spec)
    whole = qw.scales[:, g_idx.long()] * (qw.q.float() - qw.zeros[:, g_idx.long()].float())
    assert torch.equal(qw.dequantize(rows=5), whole) and torch.equal(qw.dequantize(), whole)
