"""llama.cpp's weighted scale searches for its K-quant and IQ4 grids (ggml-quants.c), vectorized over sub-blocks.

Each takes a batch of sub-blocks x (B, n) with per-weight importance w (B, n) and returns what the C function
returns for every row of the batch. float32 throughout, as in C; sums may associate differently (numpy's pairwise
sums), so a code may differ from llama.cpp's where two candidates tie to the last bit.

- `make_qx_quants` (rmse_type 1, weights given): symmetric codes l in [−nmax, nmax − 1] for the scale −max/nmax
  and 18 neighbours −(nmax ± 0.1·i)/max, each scored by the weighted least-squares fit Σ w·x·l / Σ w·l²;
- `make_qkx3_quants`: codes in [0, nmax] with a min: the range (max − min)/nmax stretched by rmin + i·rdelta, each
  candidate's codes fitted by weighted least squares for scale and min (min ≤ 0);
- `make_qp_quants`: the super-block's non-negative scale of a row of sub-block scales (or mins), then 5 rounds of
  coordinate descent on the codes;
- `iq4_block_scales`: `quantize_row_iq4_nl_impl`'s per-block search on the non-linear grid.
"""

from __future__ import annotations

import numpy as np

from geminicompress.core.kgrid import IQ4_VALUES, KTYPES, nearest_value

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)


def _nearest(x: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: round half to even (the FPU's mode), as float32."""
    return np.rint(x).astype(F32)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """(B,) the value of largest magnitude of each row, with its sign (the first one on ties, as C's `>`)."""
    idx = np.abs(x).argmax(axis=1)
    return x[np.arange(x.shape[0]), idx]


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale (B,), codes (B, n) uint8 in 0..2·nmax − 1, stored as l + nmax) for x (B, n), weights w (B, n)."""
    x, w = x.astype(F32), w.astype(F32)
    mx = _signed_max(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx)[:, None]

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        l = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
        return l, (w * x * l).sum(1, dtype=F32), (w * l * l).sum(1, dtype=F32)

    L, sumlx, suml2 = fit(F32(-nmax) / safe)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0)).astype(F32)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        l, slx, sl2 = fit(-(F32(nmax) + F32(0.1) * F32(i)) / safe)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(better[:, None], l, L)
        scale = np.where(better, slx / np.where(sl2 > 0, sl2, F32(1)), scale).astype(F32)
        best = np.where(better, scale * slx, best)
    L = np.where(zero[:, None], F32(-nmax), L)
    return np.where(zero, F32(0), scale).astype(F32), (L + nmax).astype(np.uint8)


def make_qkx3_quants(x: np.ndarray, nmax: int, w: np.ndarray, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale (B,), the_min (B,) ≥ 0 where the weight is scale·l − the_min, codes (B, n) uint8 in 0..nmax)."""
    x, w = x.astype(F32), w.astype(F32)
    lo = np.minimum(x.min(1), F32(0))
    hi = x.max(1)
    flat = hi <= lo
    span = np.where(flat, F32(1), hi - lo)[:, None]
    sum_w, sum_x = w.sum(1, dtype=F32), (w * x).sum(1, dtype=F32)
    iscale = F32(nmax) / span
    L = np.clip(_nearest(iscale * (x - lo[:, None])), 0, nmax)
    scale = (F32(1) / iscale)[:, 0]
    mn = lo.copy()
    best = (w * np.square(scale[:, None] * L + mn[:, None] - x)).sum(1, dtype=F32)
    for i in range(nstep + 1):  # as in C, the range starts at the best min so far
        span = np.where(flat, F32(1), hi - mn)[:, None]
        iscale = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / span
        l = np.clip(_nearest(iscale * (x - mn[:, None])), 0, nmax)
        sum_l, sum_l2, sum_xl = (w * l).sum(1, dtype=F32), (w * l * l).sum(1, dtype=F32), (w * l * x).sum(1, dtype=F32)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, F32(1))
        s = (sum_w * sum_xl - sum_x * sum_l) / Ds
        m = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = m > 0
        s = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, F32(1)), s)
        m = np.where(pos, F32(0), m)
        err = (w * np.square(s[:, None] * l + m[:, None] - x)).sum(1, dtype=F32)
        better = ok & (err < best)
        L = np.where(better[:, None], l, L)
        best, scale, mn = np.where(better, err, best), np.where(better, s, scale), np.where(better, m, mn)
    L = np.where(flat[:, None], F32(0), L)
    return np.where(flat, F32(0), scale).astype(F32), (-np.where(flat, lo, mn)).astype(F32), L.astype(np.uint8)


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale (B,), codes (B, n) in 0..nmax) for non-negative x (B, n) (sub-block scales or mins), weights w."""
    x, w = x.astype(F32), w.astype(F32)
    mx = x.max(1)
    zero = mx < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx)[:, None]
    iscale = F32(nmax) / safe  # (B, 1)
    L = _nearest(iscale * x)
    best = (w * np.square(x - (F32(1) / iscale) * L)).sum(1, dtype=F32)
    for i in range(-4, 5):
        if i == 0:
            continue
        isc = (F32(0.1) * F32(i) + F32(nmax)) / safe
        l = np.minimum(_nearest(isc * x), nmax)
        err = (w * np.square(x - (F32(1) / isc) * l)).sum(1, dtype=F32)
        better = err < best
        best, iscale = np.where(better, err, best), np.where(better[:, None], isc, iscale)
    L = np.minimum(_nearest(iscale * x), nmax)
    sumlx, suml2 = (w * x * L).sum(1, dtype=F32), (w * L * L).sum(1, dtype=F32)
    for _ in range(5):
        changed = np.zeros(x.shape[0], dtype=bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = np.minimum(_nearest(xi * sl2 / np.where(ok, slx, F32(1))), nmax)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = ok & (new != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new, li)
            sumlx, suml2 = np.where(take, slx2, sumlx), np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F32(1)), F32(0))
    L = np.where(zero[:, None], F32(0), L)
    return np.where(zero, F32(0), scale).astype(F32), L.astype(np.uint8)


def iq4_block_scales(x: np.ndarray, w: np.ndarray, ntry: int = 7) -> np.ndarray:
    """(B,) each block's float scale on the non-linear grid: d = max/127 refitted, then the 2·ntry + 1 trial
    inverse scales (i + K[0])/max, each refitted by weighted least squares, the best fit kept."""
    x, w = x.astype(F32), w.astype(F32)
    t = KTYPES["IQ4_NL"]
    vals = np.asarray(IQ4_VALUES, dtype=F32)
    mx = _signed_max(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx)

    def fit(inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = vals[nearest_value(t, inv[:, None] * x)]
        return (w * q * x).sum(1, dtype=F32), (w * q * q).sum(1, dtype=F32)

    d = -safe / vals[0] if ntry > 0 else safe / vals[0]
    sumqx, sumq2 = fit(F32(1) / d)
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), F32(0)).astype(F32)
    best = d * sumqx
    for i in range(-ntry, ntry + 1):
        sqx, sq2 = fit((F32(i) + vals[0]) / safe)
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = np.where(better, sqx / np.where(sq2 > 0, sq2, F32(1)), d).astype(F32)
        best = np.where(better, d * sqx, best)
    return np.where(zero, F32(0), d).astype(F32)
