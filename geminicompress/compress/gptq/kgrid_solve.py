"""GPTQ on llama.cpp's two-level grids (K-quants, IQ4): the codes chosen under GPTQ's error feedback, each
super-block's scales decided by llama.cpp's own weighted search when the solver reaches it.

Columns are solved super-block by super-block (a super-block's columns together, super-blocks by decreasing
largest H_jj, inside one its sub-blocks likewise and their columns by decreasing H_jj: act order that keeps each
block's columns contiguous). When the solve reaches a super-block, its weights as they are then (every earlier
column's error already spread over them) go through llama.cpp's search (core/kquant.py: sub-block scales and
mins, the 6-bit (Q2_K: 4-bit) codes of those against fp16 `d`/`dmin`), the importance being the Hessian diagonal
(the mean squared input, llama.cpp's importance matrix). When it reaches each sub-block, that sub-block's float
scale (and min) is searched again on its current weights and put on the super-block's fixed `d` grid; the new
codes are kept where they fit the current weights better. Then each column is rounded to the nearest code under
its sub-block's step and offset, and its error spread over the columns after it (eq. 3 of the GPTQ paper), inside
the super-block at once, to later super-blocks lazily.
"""

from __future__ import annotations

import numpy as np
import torch

from geminicompress.compress.hessian import inverse_hessian_factor
from geminicompress.core.kgrid import KCodes, KType, KTYPES, code_values, fp16, nearest_value, sub_scales
from geminicompress.core.kquant import element_weights, quantize_blocks, sub_block_fit

F32 = np.float32


def block_order(hdiag: torch.Tensor, t: KType) -> torch.Tensor:
    """(in,) the solve order: super-blocks by decreasing largest H_jj, inside each its sub-blocks likewise,
    inside each sub-block its columns by decreasing H_jj."""
    h = hdiag.float().cpu()
    order = []
    supers = h.reshape(-1, t.super).amax(1)
    for sb in torch.argsort(supers, descending=True, stable=True).tolist():
        base = sb * t.super
        sub = h[base:base + t.super].reshape(-1, t.sub)
        for k in torch.argsort(sub.amax(1), descending=True, stable=True).tolist():
            cols = torch.argsort(sub[k], descending=True, stable=True) + base + k * t.sub
            order.append(cols)
    return torch.cat(order)


def gptq_kquant(W: torch.Tensor, H: torch.Tensor, type_name: str, damp: float = 0.01,
                refit: bool = True) -> tuple[KCodes, float]:
    """W (out, in), H (in, in) = 2/N Σ xᵀx -> (the codes on `type_name`'s grid, GPTQ's loss Σ err² / 2)."""
    t = KTYPES[type_name]
    W = W.detach().float().cpu().clone()
    H = H.detach().float().cpu().clone()
    out_f, in_f = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    hdiag = torch.diag(H).clone()
    perm = block_order(hdiag, t)
    Hinv = inverse_hessian_factor(H, damp, perm, overwrite=True).contiguous().numpy()
    Wt = W.t()[perm].contiguous().numpy()  # (in, out), solve order
    perm_np, imp = perm.numpy(), hdiag.numpy().astype(F32)
    nsb, subs = in_f // t.super, t.subs
    q = np.zeros((out_f, in_f), np.uint8)
    d = np.zeros((out_f, nsb), F32)
    sc = np.zeros((out_f, nsb * subs), np.int32)
    dmin = np.zeros((out_f, nsb), F32) if t.has_min else None
    m = np.zeros((out_f, nsb * subs), np.int32) if t.has_min else None
    loss = 0.0
    for p0 in range(0, in_f, t.super):
        cols = perm_np[p0:p0 + t.super]
        sb = int(cols[0]) // t.super
        Err = _solve_super_block(t, Wt[p0:p0 + t.super], Hinv[p0:p0 + t.super, p0:p0 + t.super], cols, imp,
                                 (q, d, sc, dmin, m), sb, refit)
        if p0 + t.super < in_f:
            Wt[p0 + t.super:] -= Hinv[p0:p0 + t.super, p0 + t.super:].T @ Err  # lazy update of the rest
        loss += float(np.square(Err, dtype=np.float64).sum()) / 2
    return KCodes(t, q, d, sc, dmin, m), loss


# the super-block scale d (IQ4_NL: the block's d) tried at these multiples of llama.cpp's choice, each under GPTQ's
# feedback inside the block; each row keeps the least GPTQ loss (1.0 first: it wins ties)
TRIAL_FACTORS = (1.0, 0.88, 0.92, 0.96, 1.04, 1.08, 1.12)


def _solve_super_block(t: KType, W1: np.ndarray, Hinv1: np.ndarray, cols: np.ndarray, imp: np.ndarray,
                       out: tuple, sb: int, refit: bool) -> np.ndarray:
    """Decide super-block `sb`'s scales from its current weights W1 (super, out) (solve order; `cols` their
    columns), then solve its columns in place: llama.cpp's d and each of `TRIAL_FACTORS` times it solved side by
    side (C · out rows), each row keeping its least loss. Writes the codes into `out` = (q, d, sc, dmin, m);
    returns the scaled errors (super, out)."""
    q, d, sc, dmin, m = out
    n_out, C = W1.shape[1], len(TRIAL_FACTORS)
    local = cols - sb * t.super  # column inside the super-block
    X = np.empty((n_out, t.super), F32)
    X[:, local] = W1.T  # (out, super) in column order
    qw = np.broadcast_to(imp[sb * t.super:(sb + 1) * t.super], X.shape)
    q0, d_sb, sc_sb, dmin_sb, m_sb = quantize_blocks(t, X, qw)
    wts = np.tile(element_weights(t, X, qw), (C, 1))  # (C·out, super): the search's weights, at the decision
    d_c = fp16(np.concatenate([d_sb * F32(f) for f in TRIAL_FACTORS]))
    tile = (lambda a: None if a is None else np.tile(a, (C, 1)) if a.ndim == 2 else np.tile(a, C))  # noqa: E731
    sc_c, dmin_c, m_c = tile(sc_sb).copy(), tile(dmin_sb), tile(m_sb)
    m_c = None if m_c is None else m_c.copy()
    Wc = np.tile(W1, (1, C))  # (super, C·out)
    codes, Err = _solve_columns(t, Wc, Hinv1, local, tile(q0), wts, (d_c, sc_c, dmin_c, m_c), refit)
    pick = np.square(Err).sum(0).reshape(C, n_out).argmin(0)  # (out,)
    rows = pick * n_out + np.arange(n_out)
    W1[:] = Wc[:, rows]
    q[:, cols] = codes[:, rows].T
    d[:, sb] = d_c[rows]
    sc[:, sb * t.subs:(sb + 1) * t.subs] = sc_c[rows]
    if dmin is not None:
        dmin[:, sb], m[:, sb * t.subs:(sb + 1) * t.subs] = dmin_c[rows], m_c[rows]
    return np.ascontiguousarray(Err[:, rows])


def _solve_columns(t: KType, W1: np.ndarray, Hinv1: np.ndarray, local: np.ndarray, q0: np.ndarray, wts: np.ndarray,
                   params: tuple, refit: bool) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ over one super-block's columns W1 (super, rows) in place, under params = (d (rows,), sc (rows, subs),
    dmin, m) (sc and m refitted in place when each sub-block starts); returns (codes, scaled errors), (super, rows)."""
    d_sb, sc_sb, dmin_sb, m_sb = params
    Err = np.empty_like(W1)
    codes = np.empty(W1.shape, np.uint8)
    S, M = sub_scales(t, d_sb[:, None], sc_sb, None if dmin_sb is None else dmin_sb[:, None], m_sb)
    for j in range(t.super):
        k = int(local[j]) // t.sub
        if refit and j % t.sub == 0 and t.name != "IQ4_NL":  # a sub-block starts: its scale again, on the d grid
            _refit_sub_block(t, W1[j:j + t.sub].T, wts[:, local[j:j + t.sub]], k, d_sb, sc_sb, dmin_sb, m_sb)
            S, M = sub_scales(t, d_sb[:, None], sc_sb, None if dmin_sb is None else dmin_sb[:, None], m_sb)
        w, s = W1[j], S[:, k]
        mm = M[:, k] if M is not None else F32(0)
        safe = np.where(s != 0, s, F32(1))
        code = np.where(s != 0, nearest_value(t, (w + mm) / safe), q0[:, local[j]])
        deq = s * code_values(t, code) - mm
        Err[j] = (w - deq) / Hinv1[j, j]
        if j + 1 < t.super:
            W1[j + 1:] -= np.outer(Hinv1[j, j + 1:], Err[j])
        codes[j] = code
    return codes, Err


def _refit_sub_block(t: KType, x: np.ndarray, w: np.ndarray, k: int, d: np.ndarray, sc: np.ndarray,
                     dmin: np.ndarray | None, m: np.ndarray | None) -> None:
    """Sub-block k's current weights x (out, sub) (solve order; w their weights in the search): llama.cpp's float
    scale (and min) searched again and rounded onto the super-block's d (dmin); the codes sc (m) of each row
    replaced where the new ones give the smaller weighted rounding error of x."""
    x, w = np.ascontiguousarray(x), np.ascontiguousarray(w)
    scale, mn, _ = sub_block_fit(t, x, w)
    safe_d = np.where(d != 0, d, F32(1))
    new_sc = np.clip(np.rint(scale / safe_d), t.sc_lo, t.sc_hi).astype(np.int32)
    new_m = None
    if dmin is not None:
        new_m = np.clip(np.rint(mn / np.where(dmin != 0, dmin, F32(1))), 0, t.m_max).astype(np.int32)
    old_err = _rounding_error(t, x, w, d, sc[:, k], dmin, None if m is None else m[:, k])
    new_err = _rounding_error(t, x, w, d, new_sc, dmin, new_m)
    better = (new_err < old_err) & (d != 0)
    sc[:, k] = np.where(better, new_sc, sc[:, k])
    if m is not None:
        m[:, k] = np.where(better, new_m, m[:, k])


def _rounding_error(t: KType, x: np.ndarray, w: np.ndarray, d: np.ndarray, sc: np.ndarray,
                    dmin: np.ndarray | None, m: np.ndarray | None) -> np.ndarray:
    """(out,) Σ w·(x − x̂)² of x (out, sub) rounded to nearest under the step d·sc and offset dmin·m."""
    S, M = sub_scales(t, d[:, None], sc[:, None], None if dmin is None else dmin[:, None],
                      None if m is None else m[:, None])
    S, M = S[:, 0:1], (M[:, 0:1] if M is not None else F32(0))
    safe = np.where(S != 0, S, F32(1))
    deq = S * code_values(t, nearest_value(t, (x + M) / safe)) - M
    return (w * np.square(x - deq)).sum(1)
