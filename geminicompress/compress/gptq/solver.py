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

from dataclasses import dataclass

import numpy as np
import torch

from geminicompress.compress.hessian import inverse_hessian_factor
from geminicompress.compress.scale_search import (
    ScaleSearch,
    clip_qparams,
    importance_for,
    search_qparams,
    trial_candidates,
)
from geminicompress.core.grid import QuantizedWeight, QuantSpec, qparams, quantize
from geminicompress.core.errors import GeminiError

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


@dataclass(frozen=True)
class SolverOptions:
    """How `gptq_quantize` orders columns and decides group parameters (the stage builds one from its config).

    damp: λ = damp · mean(diag H); block_size: columns per lazy-update block; act_order: "none", "static"
    (Hessian order, groups j // group_size) or "group" (groups formed in that order; bools as the reference:
    True = "group", or "static" with static_groups); order: the static order, "global" (decreasing H_jj) or
    `group_aware_order`'s "gar"/"garsum"/"local"; group_params: "lazy" (each group's parameters decided from
    its updated weights when the solver reaches it) or "upfront" (from the original weights); clip: a
    clipping search without sign (scale_search.clip_qparams options, and "importance": "hdiag"|"hinv");
    sym_range: `grid.qparams`' range; search: a symmetric scale search (scale_search.ScaleSearch)."""

    damp: float = 0.01
    block_size: int = 128
    act_order: bool | str = False
    static_groups: bool = False
    order: str = "global"
    group_params: str = "lazy"
    clip: dict | None = None
    sym_range: str = "full"
    search: ScaleSearch | None = None

    @property
    def mode(self) -> str:
        """act_order as one of "none", "static", "group"."""
        if isinstance(self.act_order, bool):
            return ("static" if self.static_groups else "group") if self.act_order else "none"
        return self.act_order


@dataclass
class _Plan:
    """The column order of a solve and where its groups start. perm: (in,) quantization position -> column;
    pos_group: (in,) group of each position; starts: position -> the group whose first column is there;
    hdiag: (in,) the Hessian diagonal (dead inputs 1); sigma2: (out, 1) rows' mean squared weight, or None."""

    perm: torch.Tensor
    pos_group: torch.Tensor
    group_list: list[int]
    starts: dict[int, int]
    hdiag: torch.Tensor
    sigma2: torch.Tensor | None


@dataclass
class _Run:
    """The state of one solve, quantization order: Wt (in, out) the transposed weight being updated, Hinv the
    upper factor of H⁻¹, Mt (in, out) keep-zero mask or None, Q (in, out) codes, params per group."""

    Wt: torch.Tensor
    Hinv: torch.Tensor
    Mt: torch.Tensor | None
    Q: torch.Tensor
    params: list[tuple[torch.Tensor, torch.Tensor] | None]
    plan: _Plan
    spec: QuantSpec
    opts: SolverOptions


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, opts: SolverOptions | None = None, *,
                  keep_zero: torch.Tensor | None = None, overwrite: bool = False,
                  **options) -> tuple[QuantizedWeight, float]:
    """Quantize W (out, in) given the layer Hessian H (in, in) = 2/N · Σ xᵀx.

    Returns the codes/scales/zeros/g_idx (g_idx in the original column order) and the summed
    loss Σ (w − q)² / (2 [H⁻¹]_jj²), the objective GPTQ reduces.
    opts: SolverOptions; or its fields as keyword `options` (damp=..., act_order=..., search=...).
    keep_zero: bool (out, in), True where the result must dequantize to exactly 0 (see the module docstring).
    A search (ScaleSearch: signed scales, a weighted search) decides a group's scale from its weights as they
    are when the solver reaches the group (after the error feedback of the columns before it), or from the
    original weights with group_params "upfront".
    overwrite: W and H (float32) are the caller's scratch: no copy of either, so the solve holds two
    Hessian-sized buffers at most (822 MB each for an 8B model's 14336-wide down_proj), and their memory is
    released once used (W after its transposed copy is made, H after the last column), even though the
    caller's frames still name them: both are left empty, shape (0,).
    """
    opts = opts if opts is not None else SolverOptions(**options)
    _check_inputs(W, H, spec, opts, keep_zero)
    scratch = [W, H] if overwrite else []  # the caller's tensors, released below
    W = W.detach().to(torch.float32, copy=not overwrite)
    H = H.detach().to(torch.float32, copy=not overwrite)
    plan = _plan(W, H, spec, opts)
    upfront = opts.group_params == "upfront"
    params = _upfront_params(W, spec, opts, plan) if upfront else [None] * spec.groups(W.shape[1])
    perm = plan.perm
    Hinv = inverse_hessian_factor(H, opts.damp, perm if opts.mode != "none" else None, overwrite=True)  # upper factor
    del H  # its memory holds Hinv or was freed (H is this function's own copy unless overwrite)
    Wt = torch.index_select(W.t(), 0, perm)  # (in, out): column j of W is the contiguous row j here
    if overwrite:
        _release(scratch[0])
    del W
    Mt = None if keep_zero is None else torch.index_select(keep_zero.to(Wt.device).t(), 0, perm)  # as Wt
    run = _Run(Wt, Hinv, Mt, torch.zeros_like(Wt), params, plan, spec, opts)
    del Wt, Mt, Hinv  # the run holds them, and lets them go before the codes are reordered
    loss = torch.zeros((), device=run.Q.device)
    for i1 in range(0, run.Q.shape[0], opts.block_size):
        loss += _solve_block(run, i1)
    if overwrite:
        _release(scratch[1])  # H's memory (the factor was made in it) goes with Hinv
    inv = torch.argsort(perm)  # quantization position of each column
    return QuantizedWeight(q=_codes_in_column_order(run, inv), scales=torch.cat([s for s, _ in params], dim=1),
                           zeros=torch.cat([z for _, z in params], dim=1).to(torch.int32),
                           g_idx=plan.pos_group[inv].to(torch.int32), spec=spec), float(loss)


def _codes_in_column_order(run: _Run, inv: torch.Tensor) -> torch.Tensor:
    """The solve's codes as (out, in) int32 in the original column order (`inv`: each column's quantization
    position). The run's buffers go first (Wt, its mask, the factor of H⁻¹), and the codes are reordered as
    bytes (they fit: bits <= 8): an 8B model's stacked gate/up solve had its weight, its codes in float32, their
    reordered copy and the int32 result alive at once (4 x 470 MB, the streamed GPTQ run's peak); now float32
    codes, bytes and the result at most."""
    run.Wt, run.Hinv, run.Mt = run.Wt.new_empty(0), run.Hinv.new_empty(0), None
    codes = run.Q.to(torch.uint8)
    run.Q = run.Q.new_empty(0)
    return codes[inv].t().to(torch.int32)


def _check_inputs(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, opts: SolverOptions,
                  keep_zero: torch.Tensor | None) -> None:
    """One-line errors for inputs the solver cannot take (shapes, NaN/Inf, a search it cannot run)."""
    in_f = W.shape[1]
    if H.shape != (in_f, in_f):
        raise GeminiError(f"Hessian shape {tuple(H.shape)} does not match the weight's {in_f} input columns")
    if keep_zero is not None and keep_zero.shape != W.shape:
        raise GeminiError(f"keep_zero mask shape {tuple(keep_zero.shape)} does not match the weight's {tuple(W.shape)}")
    if not _all_finite(W):
        raise GeminiError("the weight holds NaN/Inf values; the model is broken before quantization")
    if not _all_finite(H):
        raise GeminiError("the Hessian holds NaN/Inf values (calibration activations overflowed); "
                          "quantize in float32 or use other calibration data")
    if opts.search is not None and not spec.sym:
        raise GeminiError("a scale search needs a symmetric grid (sym)")
    if opts.search is not None and opts.search.weights == "hinv" and opts.group_params == "upfront":
        raise GeminiError("a scale search weighted by H⁻¹ decides each group's scale when the solver reaches it")


def _plan(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, opts: SolverOptions) -> _Plan:
    """Dead inputs (H_jj = 0) get H_jj = 1 and W_:j = 0, in place; then the column order and the groups."""
    in_f = W.shape[1]
    gs = in_f if spec.group_size == -1 else spec.group_size
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    hdiag = torch.diag(H).clone()  # (in,)
    sigma2 = W.square().mean(dim=1, keepdim=True) if opts.search is not None else None  # (out, 1), llama.cpp's σ²
    mode = opts.mode
    if mode == "none":
        perm = torch.arange(in_f, device=W.device)
    elif mode == "static" and opts.order != "global":
        perm = group_aware_order(hdiag, gs, opts.order)
    else:
        perm = torch.argsort(hdiag, descending=True)
    # group of each column in quantization order: with "group" groups are formed in that order
    pos_group = (torch.arange(in_f, device=W.device) if mode == "group" else perm) // gs  # (in,)
    if spec.group_size == -1:
        pos_group = torch.zeros_like(pos_group)
    group_list = pos_group.tolist()
    starts = {group_list.index(g): g for g in set(group_list)}  # quantization position -> the group starting there
    return _Plan(perm, pos_group, group_list, starts, hdiag, sigma2)


def _upfront_params(W: torch.Tensor, spec: QuantSpec, opts: SolverOptions,
                    plan: _Plan) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Every group's (scale, zero), each (out, 1), from the original weights W (out, in)."""
    in_f, gs = W.shape[1], (W.shape[1] if spec.group_size == -1 else spec.group_size)
    params: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for g in range(spec.groups(in_f)):
        cols = torch.nonzero(plan.pos_group == g).flatten() if opts.mode == "group" else None
        orig = plan.perm[cols] if cols is not None else torch.arange(g * gs, min((g + 1) * gs, in_f), device=W.device)
        if spec.group_size == -1:
            orig = torch.arange(in_f, device=W.device)
        if opts.search is not None:
            imp = importance_for(opts.search.weights, plan.hdiag[orig], W[:, orig], plan.sigma2)
            params.append(search_qparams(W[:, orig], spec, opts.search, imp))
        else:
            params.append(_group_qparams(W[:, orig], spec, opts.clip, plan.hdiag[orig], opts.sym_range))
    return params


def _solve_block(run: _Run, i1: int) -> torch.Tensor:
    """Quantize the columns [i1, i1 + block_size) of run (quantization order), sub-block by sub-block,
    deciding each group's parameters where it starts; then the block's lazy update to the columns after it.
    Returns the block's loss Σ (w − q)² / (2 [H⁻¹]_jj²)."""
    Wt, Hinv, plan = run.Wt, run.Hinv, run.plan
    i2 = min(i1 + run.opts.block_size, Wt.shape[0])
    b = i2 - i1
    W1 = Wt[i1:i2].clone()  # (b, out)
    Err1 = torch.empty_like(W1)
    Hinv1 = Hinv[i1:i2, i1:i2]
    inv_d = (1.0 / torch.diag(Hinv1)).tolist()
    # sub-blocks end at absolute multiples of _SUB_BLOCK, at the block's end and where a group starts
    for j1, j2 in _spans(i1, i2, _SUB_BLOCK, plan.starts):
        if run.opts.group_params != "upfront" and (i1 + j1) in plan.starts:
            g = plan.starts[i1 + j1]
            run.params[g] = _decide_group(run, W1, Err1, i1, j1, g)
        cols = [run.params[plan.group_list[i1 + i]] for i in range(j1, j2)]
        _quantize_columns(W1[j1:j2], Err1[j1:j2], run.Q[i1 + j1:i1 + j2], Hinv1[j1:j2, j1:j2],
                          [(s[:, 0], z[:, 0]) for s, z in cols],
                          inv_d[j1:j2], run.spec.maxq, None if run.Mt is None else run.Mt[i1 + j1:i1 + j2])
        if j2 < b:
            W1[j2:].addmm_(Hinv1[j1:j2, j2:].t(), Err1[j1:j2], alpha=-1.0)  # to the rest of the block
    if i2 < Wt.shape[0]:
        Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1.0)  # the block's lazy update to the rest
    return Err1.square().sum() / 2


def _decide_group(run: _Run, W1: torch.Tensor, Err1: torch.Tensor, i1: int, j1: int,
                  g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group g's (scale, zero), each (out, 1), from its columns as they are now (every update so far applied),
    reached at position i1 + j1 of the block starting at i1."""
    plan, opts = run.plan, run.opts
    positions = torch.nonzero(plan.pos_group == g).flatten()
    cur = _current(run.Wt, W1, Err1, run.Hinv, i1, j1, positions)  # (out, k)
    weights = opts.search.weights if opts.search is not None else (opts.clip or {}).get("importance")
    if weights == "hinv":
        diag = 1.0 / torch.diag(run.Hinv)[positions].square()  # GPTQ's weight of each column's error
    else:
        diag = plan.hdiag[plan.perm[positions]]
    if opts.search is not None:
        best = search_qparams(cur, run.spec, opts.search, importance_for(opts.search.weights, diag, cur, plan.sigma2))
        if opts.search.trial and _contiguous(positions, i1 + j1, i1 + W1.shape[0]):
            return _trial(run, W1, i1, j1, trial_candidates(cur, run.spec, opts.search, best[0]), best[1])
        return best
    imp = diag if weights in ("hdiag", "hinv") else None
    return _group_qparams(cur, run.spec, opts.clip, imp, opts.sym_range, given_imp=True)


def _contiguous(positions: torch.Tensor, start: int, block_end: int) -> bool:
    """Whether the group's quantization positions are start, start + 1, ... and end inside the block."""
    k = positions.numel()
    return int(positions[0]) == start and int(positions[-1]) == start + k - 1 and start + k <= block_end


def _trial(run: _Run, W1: torch.Tensor, i1: int, j1: int, cands: torch.Tensor,
           zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the candidate scale (cands: (C, out, 1)) whose GPTQ solve of the group's k columns, block rows
    j1..j1+k of W1 (current: every earlier update applied), leaves the least loss Σ_j err_j², err = (w − q) /
    [H⁻¹]_jj: the group's share of GPTQ's objective, the later columns' feedback being optimal whichever.
    All candidates are solved at once, side by side as C · out rows (GPTQ's rows are independent)."""
    C, out = cands.shape[0], cands.shape[1]
    k = run.spec.group_size
    a, b = j1, j1 + k
    Wc = W1[a:b].repeat(1, C)  # (k, C·out)
    Err = torch.empty_like(Wc)
    Hinv1 = run.Hinv[i1 + a:i1 + b, i1 + a:i1 + b]
    inv_d = (1.0 / torch.diag(Hinv1)).tolist()
    s, z = cands.reshape(-1), zero[:, 0].repeat(C)  # (C·out,)
    mask = None if run.Mt is None else run.Mt[i1 + a:i1 + b].repeat(1, C)
    # the updates as contiguous rows of Hinv1ᵀ: numpy's product of a strided column with a wide matrix took
    # ~1000x longer; the sums' order may differ from the solve's, which only ranks the candidates here
    HinvT = Hinv1.t().contiguous()
    for i in range(k):
        w = Wc[i]
        if i:
            w.sub_(HinvT[i, :i] @ Err[:i])
        q = quantize(w, s, z, run.spec.maxq)
        if mask is not None:
            q = torch.where(mask[i], z, q)
        Err[i] = (w - s * (q - z)) * inv_d[i]
    loss = Err.square().sum(dim=0).reshape(C, out)
    pick = loss.argmin(dim=0)  # (out,), ties to the first: the searched scale
    return cands[pick, torch.arange(out)], zero


def group_aware_order(hdiag: torch.Tensor, gs: int, order: str = "gar") -> torch.Tensor:
    """A quantization order that keeps each group of `gs` consecutive columns together: inside a group,
    columns by decreasing H_jj; groups by decreasing largest H_jj ("gar", GPTQModel's group-aware
    reordering) or in their original order ("local"). hdiag: (in,) -> perm (in,)."""
    in_f = hdiag.numel()
    groups = [torch.arange(g, min(g + gs, in_f), device=hdiag.device) for g in range(0, in_f, gs)]
    inside = [cols[torch.argsort(hdiag[cols], descending=True)] for cols in groups]
    if order == "gar":
        key = torch.stack([hdiag[cols].max() for cols in groups])
    elif order == "garsum":
        key = torch.stack([hdiag[cols].sum() for cols in groups])
    elif order == "local":
        key = -torch.arange(len(groups), dtype=hdiag.dtype, device=hdiag.device)
    else:
        raise ValueError(order)
    return torch.cat([inside[int(g)] for g in torch.argsort(key, descending=True)])


def _group_qparams(w: torch.Tensor, spec: QuantSpec, clip: dict | None, imp: torch.Tensor | None,
                   sym_range: str, given_imp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if clip is None:
        return qparams(w, spec, sym_range=sym_range)
    if not given_imp and clip.get("importance") != "hdiag":
        imp = None
    return clip_qparams(w, spec, imp, grid=clip.get("grid", 20), maxshrink=clip.get("maxshrink", 0.2),
                        norm=clip.get("norm", 2.0), sym_range=sym_range)


def _current(Wt: torch.Tensor, W1: torch.Tensor, Err1: torch.Tensor, Hinv: torch.Tensor, i1: int, j: int,
             positions: torch.Tensor) -> torch.Tensor:
    """The columns at quantization `positions` (all ≥ i1 + j, the start of a sub-block), with every update
    made so far applied, as (out, k). Rows inside the block are current in W1; rows past it still lack the
    lazy update from this block's first j rows."""
    i2 = i1 + W1.shape[0]
    inside = positions[positions < i2]
    beyond = positions[positions >= i2]
    cur = torch.cat([W1[inside - i1], Wt[beyond] - Hinv[i1:i1 + j, beyond].t() @ Err1[:j]])  # either part may be empty
    order = torch.argsort(torch.cat([inside, beyond]))
    return cur[order].t()


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


def _spans(i1: int, i2: int, sub: int, starts: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Block-local (start, stop) of the sub-blocks of columns [i1, i2), cut at absolute multiples of sub and
    at every position in `starts` (where a group's parameters are decided)."""
    cuts = sorted({i1, i2, *range((i1 // sub + 1) * sub, i2, sub), *(p for p in (starts or {}) if i1 < p < i2)})
    return [(a - i1, b - i1) for a, b in zip(cuts, cuts[1:])]
