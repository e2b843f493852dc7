"""Fixed-mask reconstruction: the masked least-squares math (prune/refit.py) against a per-row lstsq, and
the layer-wise pass (distill/reconstruct.py) on a tiny pruned model against its dense teacher."""

import copy

import pytest
import torch
from tiny import prune_in_place, tiny_model

from geminicompress.compress.prune.refit import refit_masked, subset_solve
from geminicompress.core.arch import arch_for, get_module
from geminicompress.distill.reconstruct import reconstruct
from geminicompress.core.errors import InputError

CPU = torch.device("cpu")


def _problem(out=9, cols=12, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(cols, n, generator=g, dtype=torch.float64)
    X[3] = X[1] * 0.9 + 0.1 * X[3]  # correlated inputs, so that refitting matters
    W = torch.randn(out, cols, generator=g, dtype=torch.float64)
    keep = torch.rand(out, cols, generator=g) > torch.linspace(0.05, 0.95, out).unsqueeze(1)  # rows 5%..95% pruned
    keep[0] = True  # nothing pruned: the row must come back unchanged
    keep[-1] = False  # everything pruned: all zeros
    return W, X, keep


def _lstsq_rows(W, X, keep):
    """Reference: row by row, min ‖X_Sᵀ w_S − Xᵀ w‖² by numpy-style least squares."""
    out = torch.zeros_like(W)
    for r in range(W.shape[0]):
        S = keep[r].nonzero().squeeze(1)
        if len(S):
            out[r, S] = torch.linalg.lstsq(X[S].T, X.T @ W[r]).solution
    return out


def test_refit_equals_per_row_least_squares_in_both_forms():
    W, X, keep = _problem()
    H = 2 * X @ X.T
    sizes = keep.sum(1)
    assert (sizes <= 6).any() and (sizes > 6).any()  # rows go through both closed forms
    got = refit_masked(W, H, keep, damp=0.0, dtype=torch.float64)
    torch.testing.assert_close(got, _lstsq_rows(W, X, keep), rtol=1e-8, atol=1e-9)
    assert torch.all(got[~keep] == 0)
    torch.testing.assert_close(got[0], W[0])


def test_refit_beats_plain_masking_and_is_a_minimum_on_the_calibration_inputs():
    W, X, keep = _problem(seed=1)
    X = torch.randn(12, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64) @ X  # correlated inputs
    W, X = W.float(), X.float()
    H = 2 * X @ X.T
    got = refit_masked(W, H, keep, damp=0.0)
    assert got.dtype == torch.float32 and torch.all(got[~keep] == 0)
    err = lambda V: float(((V - W) @ X).square().sum())  # noqa: E731
    assert err(got) < 0.6 * err(W * keep)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):  # any other weights on the same support do worse
        assert err(got + 1e-2 * torch.randn(W.shape, generator=g) * keep) > err(got)


def test_subset_solve_does_not_depend_on_the_batch_size():
    W, X, keep = _problem(seed=2)
    A = X @ X.T + torch.eye(12, dtype=torch.float64)
    big = subset_solve(A, keep, W)
    one_by_one = subset_solve(A, keep, W, batch_bytes=1)
    torch.testing.assert_close(big, one_by_one, rtol=0, atol=1e-12)
    r = 4
    S = keep[r].nonzero().squeeze(1)
    torch.testing.assert_close(big[r, S], torch.linalg.solve(A[S][:, S], W[r, S]))


def _pruned_copy(teacher, fraction=0.5):
    student = copy.deepcopy(teacher)
    return student, prune_in_place(student, fraction)


def _windows(n=8, t=32, seed=0):
    return torch.randint(0, 384, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logit_error(student, teacher, ids):
    return float((student(ids).logits - teacher(ids).logits).square().mean())


def test_reconstruct_brings_the_pruned_model_back_towards_its_teacher_and_keeps_the_zeros():
    torch.manual_seed(0)
    teacher = tiny_model(num_hidden_layers=3).eval()
    student, masks = _pruned_copy(teacher)
    held_out = _windows(4, seed=1)
    before = _logit_error(student, teacher, held_out)
    summary = reconstruct(student, teacher, _windows(32), masks, device=CPU)
    after = _logit_error(student, teacher, held_out)
    assert after < 0.85 * before, (before, after)  # random tiny weights: measured 0.29 -> 0.23
    params = dict(student.named_parameters())
    for name, keep in masks.items():
        assert torch.all(params[name][~keep] == 0), name
    assert len(summary["layers"]) == 3
    for row in summary["layers"]:
        assert row["error_after"] < row["error_before"]
    # untouched: everything outside the decoder linears
    t_params = dict(teacher.named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(params[name], t_params[name])


def test_reconstruct_layer_matches_the_closed_form_on_its_own_inputs():
    """Layer 0's q_proj sees the embeddings through the input norm: refit it by hand and compare."""
    torch.manual_seed(0)
    teacher = tiny_model(num_hidden_layers=2).eval()
    student, masks = _pruned_copy(teacher)
    ids = _windows()
    layer0 = get_module(student, arch_for(student).layers)[0]
    xs = []
    h = layer0.self_attn.q_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].flatten(0, 1).double()))
    with torch.no_grad():
        student(ids)
    h.remove()
    X = torch.cat(xs).T  # (in, tokens)
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = refit_masked(dict(teacher.named_parameters())[name].detach(), 2 * X @ X.T / X.shape[1], masks[name])
    reconstruct(student, teacher, ids, masks, device=CPU)
    torch.testing.assert_close(dict(student.named_parameters())[name].detach(), expected, rtol=1e-4, atol=1e-5)


def test_reconstruct_refuses_a_student_of_another_shape():
    teacher = tiny_model(num_hidden_layers=3)
    student, masks = _pruned_copy(tiny_model(num_hidden_layers=2))
    with pytest.raises(InputError, match="2 decoder layers and the teacher 3"):
        reconstruct(student, teacher, _windows(), masks, device=CPU)
    dense = copy.deepcopy(teacher)
    with pytest.raises(InputError, match="no pruned decoder linear"):
        reconstruct(dense, teacher, _windows(), {}, device=CPU)
