"""Round-to-nearest onto llama.cpp's K-quant and IQ4 grids the way llama-quantize does it (ggml-quants.c,
`quantize_row_<type>_impl`): per sub-block a weighted search for its float scale (and min), per super-block the
fp16 `d` (and `dmin`) and the sub-blocks' integer codes found by a second weighted search over those scales, then
every weight rounded to the nearest code under its sub-block's final step. No error feedback (GPTQ's is
compress/gptq/kgrid_solve.py).

Importance: `importance` (cols,) is llama.cpp's importance matrix for the tensor (the mean squared input of each
column); the weight of each element is then, as in llama.cpp's imatrix path, `qw[j] · sqrt(σ² + x[j]²)` with σ²
the super-block's mean square (times 2 except Q2_K), and Q6_K's `qw[j]` alone. Without one: the weights of
llama.cpp's `_impl` functions without quant_weights (x², or σ + |x| for Q4_K/Q5_K; Q2_K, which has none there:
1), not its `_ref` functions' different searches.
"""

from __future__ import annotations

import numpy as np

from geminicompress.core.kgrid import KCodes, KType, KTYPES, fp16, nearest_value
from geminicompress.core.kquant_search import iq4_block_scales, make_qkx3_quants, make_qp_quants, make_qx_quants

F32 = np.float32
ROWS_PER_CHUNK = 2048  # rows quantized at once (the searches hold a few (rows, cols) float32 temporaries)


def element_weights(t: KType, X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(B, super) the weight of each element's squared error in the sub-block searches, for the super-blocks X
    (B, super) and their columns' importance qw (B, super) or None."""
    sigma2 = np.square(X).sum(1, dtype=F32, keepdims=True) / F32(t.super)
    if t.name != "Q2_K":
        sigma2 = F32(2) * sigma2
    if t.name == "Q6_K":
        return qw if qw is not None else np.square(X)
    if qw is not None:
        return qw * np.sqrt(sigma2 + np.square(X))
    if t.name in ("Q4_K", "Q5_K"):
        return np.sqrt(sigma2) + np.abs(X)
    return np.ones_like(X) if t.name == "Q2_K" else np.square(X)


def sub_block_fit(t: KType, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Each sub-block's float (scale, min or None, codes) by llama.cpp's search for the type: x, w (B, sub)."""
    if t.has_min:
        nstep = 36
        scale, mn, L = make_qkx3_quants(x, t.maxq, w, -0.9, 0.05, nstep)
        return scale, mn, L
    if t.values is not None:
        return iq4_block_scales(x, w), None, np.zeros(x.shape, dtype=np.uint8)
    scale, L = make_qx_quants(x, (t.maxq + 1) // 2, w)
    return scale, None, L


def super_block_codes(t: KType, scales: np.ndarray, mins: np.ndarray | None, sw: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(d, sc, dmin, m): a super-block's fp16 d (B,) (dmin) and its sub-blocks' integer multipliers (B, subs)
    for their float scales (mins) (B, subs), weighted by the sub-blocks' summed element weights sw (B, subs)."""
    if t.has_min:
        dm, Ls = make_qp_quants(scales, t.sc_hi, sw)
        mm, Lm = make_qp_quants(mins, t.m_max, sw)
        return fp16(dm), Ls.astype(np.int32), fp16(mm), Lm.astype(np.int32)
    if t.name == "Q3_K":
        d, Ls = make_qx_quants(scales, 32, sw)
        return fp16(d), Ls.astype(np.int32) - 32, None, None
    mx = np.take_along_axis(scales, np.abs(scales).argmax(1)[:, None], 1)[:, 0]  # signed largest scale
    if t.name == "Q6_K":
        zero = np.abs(mx) < F32(1e-15)
        iscale = F32(-128) / np.where(zero, F32(1), mx)
        sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int32)
        return np.where(zero, F32(0), fp16(F32(1) / iscale)), np.where(zero[:, None], 0, sc), None, None
    d = -mx / F32(32)  # IQ4_XS: codes from the unrounded d, as llama.cpp
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    sc = np.clip(np.rint(inv[:, None] * scales), -32, 31).astype(np.int32)
    return d.astype(F32), sc, None, None


def requantize(t: KType, X: np.ndarray, S: np.ndarray, M: np.ndarray | None, L: np.ndarray) -> np.ndarray:
    """The codes (B, super) of X (B, super) rounded to nearest under each sub-block's step S and offset M (B, subs);
    a sub-block whose step is 0 keeps its codes L."""
    x = X.reshape(X.shape[0], -1, t.sub)
    Sx = S[:, :, None]
    safe = np.where(Sx != 0, Sx, F32(1))
    if t.values is not None:
        inv = np.where(Sx != 0, F32(1) / safe, F32(0))
        return nearest_value(t, inv * x).reshape(X.shape)
    y = (x + M[:, :, None]) / safe if M is not None else x / safe
    q = nearest_value(t, y)
    return np.where(Sx != 0, q, L.reshape(x.shape)).reshape(X.shape)


def quantize_blocks(t: KType, X: np.ndarray, qw: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """llama.cpp's quantization of the super-blocks X (B, super): (q (B, super), d (B,), sc (B, subs), dmin, m)."""
    X = X.astype(F32)
    B = X.shape[0]
    w = element_weights(t, X, qw)
    xs, ws = X.reshape(-1, t.sub), w.reshape(-1, t.sub)
    scale, mn, L = sub_block_fit(t, xs, ws)
    scales = scale.reshape(B, t.subs)
    if t.name == "IQ4_NL":
        d = fp16(scales[:, 0])
        inv = np.where(scales[:, 0] != 0, F32(1) / np.where(scales[:, 0] != 0, scales[:, 0], F32(1)), F32(0))
        q = nearest_value(t, inv[:, None] * X)
        return q, d, np.ones((B, 1), np.int32), None, None
    sw = ws.sum(1, dtype=F32).reshape(B, t.subs)
    d, sc, dmin, m = super_block_codes(t, scales, None if mn is None else mn.reshape(B, t.subs), sw)
    if t.name == "IQ4_XS":  # the codes under the unrounded d, as llama.cpp; d stored as fp16
        q = requantize(t, X, d[:, None] * sc.astype(F32), None, L)
        return q, fp16(d), sc, None, None
    S = d[:, None] * sc.astype(F32)
    M = None if dmin is None else dmin[:, None] * m.astype(F32)
    return requantize(t, X, S, M, L), d, sc, dmin, m


def quantize(w: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> KCodes:
    """w (rows, cols) float -> its KCodes on `type_name`'s grid, rounded as llama-quantize does.
    importance: (cols,) the columns' mean squared input (llama.cpp's imatrix), or None."""
    t = KTYPES[type_name]
    rows, cols = w.shape
    if cols % t.super:
        raise ValueError(f"{type_name} needs a multiple of {t.super} columns, got {cols}")
    nsb = cols // t.super
    out = {"q": [], "d": [], "sc": [], "dmin": [], "m": []}
    for r in range(0, rows, ROWS_PER_CHUNK):
        part = np.asarray(w[r:r + ROWS_PER_CHUNK], dtype=F32)
        n = part.shape[0]
        qw = None if importance is None else np.broadcast_to(
            np.asarray(importance, F32).reshape(1, nsb, t.super), (n, nsb, t.super)).reshape(-1, t.super)
        q, d, sc, dmin, m = quantize_blocks(t, part.reshape(-1, t.super), qw)
        out["q"].append(q.reshape(n, cols))
        out["d"].append(d.reshape(n, nsb))
        out["sc"].append(sc.reshape(n, -1))
        if dmin is not None:
            out["dmin"].append(dmin.reshape(n, nsb))
            out["m"].append(m.reshape(n, -1))
    cat = {k: (np.concatenate(v) if v else None) for k, v in out.items()}
    return KCodes(t, cat["q"], cat["d"], cat["sc"], cat["dmin"], cat["m"])
