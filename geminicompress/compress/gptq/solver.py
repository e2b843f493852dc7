"""The GPTQ solver (Frantar, Ashkboos, Hoefler & Alistarh, 2022, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers"), as a pure function on tensors.

Minimise ‖W X − Ŵ X‖² column by column (Optimal Brain Quantization): quantize column j, then
spread its error over the not-yet-quantized columns with the inverse Hessian (eq. 3),

    δ = −(w_j − q_j) / [H⁻¹]_jj · [H⁻¹]_{j,:}

using the upper Cholesky factor of H⁻¹ instead of updating H⁻¹ after every column (§4, step 3), and
applying updates lazily: inside a block of `block_size` columns, then once to the rest (§4, step 2).

Options as in the reference implementation and AutoGPTQ:
- dead inputs (zero Hessian diagonal: the input never fires) get H_jj = 1 and W_:j = 0;
- `damp`: λ = damp · mean(diag H) added to the diagonal;
- `act_order`: columns in order of decreasing H_jj; `static_groups` fixes the groups (and their
  scales) in the original column order first, so that g_idx stays j // group_size.
- `keep_zero`: entries that must stay exactly zero (a pruned weight's zeros): they are given their group's
  zero point, i.e. dequantize to 0, and their whole value is the error spread over the later columns, as
  SparseGPT does for the weights it prunes. Without it the error feedback moves pruned weights off zero.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from geminicompress.compress.grid import QuantizedWeight, QuantSpec, qparams, quantize
from geminicompress.compress.hessian import inverse_hessian_factor
from geminicompress.errors import GeminiError

_SUB_BLOCK = 32  # columns per rank-1 sub-block (the rest of the work goes through matmuls)
_NUMPY_ON_CPU = True  # the column loop on numpy views on the CPU (tests switch it off to check the torch loop)


def _all_finite(t: torch.Tensor, rows: int = 1024) -> bool:
    """torch.isfinite(t).all(), a block of rows at a time: on a whole 14336² Hessian isfinite's temporaries
    (|t| and two masks) took 1.3 GB, more than the solve itself (measured on an 8B-shaped down_proj)."""
    return all(bool(torch.isfinite(t[i:i + rows]).all()) for i in range(0, t.shape[0], rows))


def zeros_to_keep(W: torch.Tensor, keep: bool, rows: int = 1024) -> torch.Tensor | None:
    """The `keep_zero` mask for W (out, in): W == 0 when `keep` and W holds any exact zero, else None.
    Counted a block of rows at a time (no W-sized temporary when there is nothing to keep)."""
    if not keep or not any(bool((W[i:i + rows] == 0).any()) for i in range(0, W.shape[0], rows)):
        return None
    return W == 0


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, *, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False, static_groups: bool = False, keep_zero: torch.Tensor | None = None,
                  overwrite: bool = False) -> tuple[QuantizedWeight, float]:
    """Quantize W (out, in) given the layer Hessian H (in, in) = 2/N · Σ xᵀx.

    Returns the codes/scales/zeros/g_idx (g_idx in the original column order) and the summed
    loss Σ (w − q)² / (2 [H⁻¹]_jj²), the objective GPTQ reduces.
    keep_zero: bool (out, in), True where the result must dequantize to exactly 0 (see the module docstring).
    overwrite: W and H (float32) are the caller's scratch: no copy of either, so the solve holds two
    Hessian-sized buffers at most (822 MB each for an 8B model's 14336-wide down_proj), and their memory is
    released once used (W after its transposed copy is made, H after the last column), even though the
    caller's frames still name them: both are left empty, shape (0,).
    """
    out_f, in_f = W.shape
    if H.shape != (in_f, in_f):
        raise GeminiError(f"Hessian shape {tuple(H.shape)} does not match the weight's {in_f} input columns")
    if keep_zero is not None and keep_zero.shape != W.shape:
        raise GeminiError(f"keep_zero mask shape {tuple(keep_zero.shape)} does not match the weight's {tuple(W.shape)}")
    if not _all_finite(W):
        raise GeminiError("the weight holds NaN/Inf values; the model is broken before quantization")
    if not _all_finite(H):
        raise GeminiError("the Hessian holds NaN/Inf values (calibration activations overflowed); "
                          "quantize in float32 or use other calibration data")
    scratch = [W, H] if overwrite else []  # the caller's tensors, released below
    W = W.detach().to(torch.float32, copy=not overwrite)
    H = H.detach().to(torch.float32, copy=not overwrite)
    gs = in_f if spec.group_size == -1 else spec.group_size

    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if spec.group_size == -1:
        static = [qparams(W, spec)]  # per channel: one range over the whole row, fixed up front
    elif static_groups:
        static = [qparams(W[:, g:g + gs], spec) for g in range(0, in_f, gs)]

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f, device=W.device)
    Hinv = inverse_hessian_factor(H, damp, perm if act_order else None, overwrite=True)  # upper factor of H⁻¹
    del H  # its memory holds Hinv or was freed (H is this function's own copy unless overwrite)
    Wt = torch.index_select(W.t(), 0, perm)  # (in, out): column j of W is the contiguous row j here
    if overwrite:
        _release(scratch[0])
    del W
    Mt = None if keep_zero is None else torch.index_select(keep_zero.to(Wt.device).t(), 0, perm)  # as Wt

    Q = torch.zeros_like(Wt)  # codes, quantization order: (in, out)
    # group of each column in quantization order: fixed groups follow the original columns
    cols = perm if static else torch.arange(in_f, device=Wt.device)
    group_of = torch.zeros(in_f, dtype=torch.long, device=Wt.device) if spec.group_size == -1 else cols // gs
    group_list = group_of.tolist()
    # error updates: rank-1 inside sub-blocks of `sub` columns, one matmul per sub-block to the rest of
    # the block, one per block to the remaining columns (the same sums, mostly as matmuls). A new dynamic
    # group starts on a sub-block boundary (sub divides gs), where every update so far has been applied.
    sub = math.gcd(_SUB_BLOCK, gs) if not static else _SUB_BLOCK
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    loss = torch.zeros((), device=Wt.device)
    scale = zero = None
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        b = i2 - i1
        W1 = Wt[i1:i2].clone()  # (b, out)
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        inv_d = (1.0 / torch.diag(Hinv1)).tolist()
        # sub-blocks end at absolute multiples of `sub` (and at the block's end), so group starts align
        for j1, j2 in _spans(i1, i2, sub):
            params = []  # (scale, zero) of each column of the sub-block, as (out,) vectors
            for i in range(j1, j2):
                col = i1 + i
                if static:
                    scale, zero = static[group_list[col]]
                elif col % gs == 0:  # a new group starts here (always a sub-block start), in quantization order
                    scale, zero = qparams(_upcoming(Wt, W1, Err1, Hinv, i1, i, gs), spec)
                    scales.append(scale)
                    zeros.append(zero)
                params.append((scale[:, 0], zero[:, 0]))
            _quantize_columns(W1[j1:j2], Err1[j1:j2], Q[i1 + j1:i1 + j2], Hinv1[j1:j2, j1:j2], params,
                              inv_d[j1:j2], spec.maxq, None if Mt is None else Mt[i1 + j1:i1 + j2])
            if j2 < b:
                W1[j2:].addmm_(Hinv1[j1:j2, j2:].t(), Err1[j1:j2], alpha=-1.0)  # to the rest of the block
        loss += Err1.square().sum() / 2  # Σ (w − q)² / (2 [H⁻¹]_jj²)
        if i2 < in_f:
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1.0)  # the block's lazy update to the rest

    if static:
        scales = [sc for sc, _ in static]
        zeros = [zr for _, zr in static]
    if overwrite:
        _release(scratch[1])  # H's memory (the factor was made in it) goes with Hinv
    del Wt, Hinv, scratch
    inv = torch.argsort(perm)
    g_idx = group_of[inv].to(torch.int32)
    Q = Q[inv]
    qw = QuantizedWeight(
        q=Q.t().to(torch.int32),
        scales=torch.cat(scales, dim=1),  # (out, groups)
        zeros=torch.cat(zeros, dim=1).to(torch.int32),
        g_idx=g_idx,
        spec=spec,
    )
    return qw, float(loss)


def _release(*tensors: torch.Tensor) -> None:
    """Make the caller's `tensors` empty (shape (0,)), so that their memory is freed as soon as this
    function's own views of it are gone, although the caller's frames still name them."""
    for t in tensors:
        t.set_()


def _quantize_columns(W: torch.Tensor, Err: torch.Tensor, Q: torch.Tensor, Hinv: torch.Tensor,
                      params: list[tuple[torch.Tensor, torch.Tensor]], inv_d: list[float], maxq: int,
                      keep_zero: torch.Tensor | None = None) -> None:
    """Quantize the k consecutive columns of a sub-block one after the other, in place (eq. 3):
    W, Err, Q: (k, out) rows of the transposed weight, its scaled errors and its codes; Hinv: (k, k);
    keep_zero: (k, out) bool or None, entries whose code is the zero point (they dequantize to 0).

    Left-looking: column i first takes the updates of the columns before it in one product,
    w_i −= Σ_{j<i} [H⁻¹]_ji · err_j, then is quantized. The same sums as GPTQ's rank-1 updates after every
    column, in one operation instead of a shrinking rank-1 update per column. On the CPU the loop runs
    on numpy views of the same memory: per column it is ~10 operations on (out,) vectors, where torch's
    per-call overhead (~3 µs) costs more than the arithmetic (measured 9-15 vs 26 µs per column)."""
    if W.device.type == "cpu" and _NUMPY_ON_CPU:
        _columns_numpy(W.numpy(), Err.numpy(), Q.numpy(), Hinv.numpy(),
                       [(s.numpy(), z.numpy()) for s, z in params], inv_d, maxq,
                       None if keep_zero is None else keep_zero.numpy())
        return
    for i, (s, z) in enumerate(params):
        w = W[i]
        if i:
            w.sub_(Hinv[:i, i] @ Err[:i])
        q = quantize(w, s, z, maxq)
        if keep_zero is not None:
            q = torch.where(keep_zero[i], z, q)
        Q[i] = q
        Err[i] = (w - s * (q - z)) * inv_d[i]


def _columns_numpy(W: np.ndarray, Err: np.ndarray, Q: np.ndarray, Hinv: np.ndarray,
                   params: list[tuple[np.ndarray, np.ndarray]], inv_d: list[float], maxq: int,
                   keep_zero: np.ndarray | None = None) -> None:
    """`_quantize_columns` on numpy arrays, written into the given buffers (no temporaries but one)."""
    deq = np.empty(W.shape[1], dtype=W.dtype)
    for i, (s, z) in enumerate(params):
        w, q, e = W[i], Q[i], Err[i]
        if i:
            w -= Hinv[:i, i] @ Err[:i]
        np.divide(w, s, out=q)  # q = clamp(round(w / s) + z, 0, maxq), as grid.quantize
        np.rint(q, out=q)  # half to even, like torch.round
        q += z
        np.clip(q, 0, maxq, out=q)
        if keep_zero is not None:
            np.copyto(q, z, where=keep_zero[i])  # the zero point: dequantizes to exactly 0
        np.subtract(q, z, out=deq)
        np.multiply(deq, s, out=deq)
        np.subtract(w, deq, out=e)
        e *= inv_d[i]  # (w − q) / [H⁻¹]_jj


def _spans(i1: int, i2: int, sub: int) -> list[tuple[int, int]]:
    """Block-local (start, stop) of the sub-blocks of columns [i1, i2), cut at absolute multiples of sub."""
    cuts = [i1] + list(range((i1 // sub + 1) * sub, i2, sub)) + [i2]
    return [(a - i1, b - i1) for a, b in zip(cuts, cuts[1:])]


def _upcoming(Wt: torch.Tensor, W1: torch.Tensor, Err1: torch.Tensor, Hinv: torch.Tensor,
              i1: int, i: int, gs: int) -> torch.Tensor:
    """The next `gs` columns from block-local position i, with every update made so far applied, as
    (out, gs). Layouts are transposed: Wt (in, out), W1 and Err1 (block, out).

    Rows inside the block are current in W1 (i starts a sub-block); rows past the block (a group wider
    than the rest of the block) still lack the lazy update from this block's first i rows, applied here.
    """
    i2 = i1 + W1.shape[0]
    inside = W1[i:i + gs]
    missing = gs - inside.shape[0]
    if missing > 0:
        beyond = Wt[i2:i2 + missing] - Hinv[i1:i1 + i, i2:i2 + missing].t() @ Err1[:i]
        inside = torch.cat([inside, beyond], dim=0)
    return inside.t()
