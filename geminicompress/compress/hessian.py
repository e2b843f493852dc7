"""Running estimate of the layer Hessian H = 2/N · Σ xᵀx of the squared reconstruction error, and the
damped H and upper Cholesky factor of H⁻¹ that the solvers read.

Shared by GPTQ (Frantar et al., 2022, eq. 1-2), SparseGPT (Frantar & Alistarh, 2023) and the masked
refit (prune/refit.py). Damping as in the GPTQ reference: λ = damp · mean(diag H) added to the diagonal,
after dead inputs (H_jj = 0: the input never fires) get H_jj = 1.

Optionally the first token of every window counts `first_token_weight` times (H = 2/N · Σ_t c_t x_tᵀx_t
with c = w at position 0, else 1; N still counts tokens). Why: in a decoder the first position is the
attention sink (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"): most
heads put much of every query's attention on it, so an error in that token's value vector reaches every
later position, while in the unweighted H it is 1 token in T. Measured on the demo model
(docs/gptq.md, "Defaults, and why"): unweighted GPTQ put 10-40x round-to-nearest's relative error on v_proj's output
at position 0 in layers 12-28, and lost to round-to-nearest in perplexity.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from geminicompress.compress.inplace import mirror_lower_, permute_symmetric_
from geminicompress.core.errors import GeminiError


class HessianAccumulator:
    """`add_batch(x)` with x: (..., in) inputs of one linear layer; `H`: (in, in) float32.

    On the CPU, inputs accumulate only the blocks on and above the diagonal (H is symmetric), in blocks of
    about `_BLOCK` columns, and `H` mirrors them once when read: k(k+1)/2 of k² blocks. Measured on
    2 cores per 2048-token batch: 4.9 vs 6.6 ms for the demo's 576-wide inputs (3 blocks), 35 vs 48 ms for
    its 1536-wide down_proj (8 blocks). On a GPU one matmul is faster than many small ones."""

    _BLOCK = 192

    def __init__(self, columns: int, device: torch.device | str = "cpu", first_token_weight: float = 1.0) -> None:
        self.first_token_weight = first_token_weight
        self._H = torch.zeros(columns, columns, device=device, dtype=torch.float32)
        k = max(1, round(columns / self._BLOCK)) if self._H.device.type == "cpu" else 1
        self._edges = [round(i * columns / k) for i in range(k + 1)]
        self.tokens = 0

    @property
    def H(self) -> torch.Tensor:
        e = self._edges
        for a in range(len(e) - 1):  # lower blocks from the upper ones
            for b in range(a + 1, len(e) - 1):
                self._H[e[b]:e[b + 1], e[a]:e[a + 1]] = self._H[e[a]:e[a + 1], e[b]:e[b + 1]].t()
        return self._H

    def add_batch(self, x: torch.Tensor) -> None:
        """x in any float dtype; the products are float32. (bfloat16 inputs are exact in float32, and a
        bfloat16 matmul would round each batch's xᵀx to bfloat16: on the demo model that made layer 0's
        o_proj Hessian indefinite even after 1% dampening, because outlier channels make its largest
        entries hundreds of times the mean diagonal.)"""
        w = self.first_token_weight
        if w != 1.0 and x.dim() < 3:
            raise ValueError(f"first_token_weight needs (b, T, in) windows, got inputs of shape {tuple(x.shape)}")
        first = x[..., 0, :].reshape(-1, x.shape[-1]).to(self._H.device, torch.float32) if w != 1.0 else None  # (b, in)
        x = x.reshape(-1, x.shape[-1]).to(self._H.device, torch.float32)  # (t, in)
        t = x.shape[0]
        # H ← H·n/(n+t) + 2/(n+t)·xᵀx, no scaled copy of x; then the first tokens' extra (w − 1) share
        beta, alpha = self.tokens / (self.tokens + t), 2.0 / (self.tokens + t)
        self._add(x, beta, alpha)
        if first is not None:
            self._add(first, 1.0, alpha * (w - 1.0))
        self.tokens += t

    def _add(self, x: torch.Tensor, beta: float, alpha: float) -> None:
        """H ← beta·H + alpha·xᵀx on the blocks on and above the diagonal.  x: (t, in) float32."""
        e = self._edges
        if len(e) == 2:
            self._H.addmm_(x.t(), x, beta=beta, alpha=alpha)
            return
        for a in range(len(e) - 1):
            xa = x[:, e[a]:e[a + 1]]
            for b in range(a, len(e) - 1):
                self._H[e[a]:e[a + 1], e[b]:e[b + 1]].addmm_(xa.t(), x[:, e[b]:e[b + 1]], beta=beta, alpha=alpha)


def damped_hessian(H: torch.Tensor, damp: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """H + damp·mean(diag H)·I as a new tensor in dtype, with dead inputs (H_jj = 0) given H_jj = 1. H: (in, in)."""
    H = H.detach().to(dtype, copy=True)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    return H


def inverse_hessian_factor(H: torch.Tensor, damp: float, perm: torch.Tensor | None = None, *,
                           overwrite: bool = False) -> torch.Tensor:
    """Upper Cholesky factor U of (P H Pᵀ + λI)⁻¹ = UᵀU, λ = damp · mean(diag H), P the permutation `perm`
    (None: none), dead inputs (H_jj = 0) given H_jj = 1 first: the rows GPTQ and SparseGPT spread each
    column's error with. H: (in, in) -> U: (in, in) float32, a column-major view. Only H's lower triangle
    is read (after the permutation).

    overwrite: H (float32) is the caller's scratch, and every step happens in its memory: the permutation
    and the mirroring of the lower triangle by in-place data movement (inplace.py), then Cholesky, inverse
    and upper factor by LAPACK in place on the column-major view (torch writes `out=` the input itself
    without a temporary). No second Hessian-sized buffer (822 MB for an 8B model's 14336-wide down_proj):
    the same bits as computing into fresh buffers (tests/test_gptq_memory.py). Raises GeminiError if H is
    not positive definite after damping."""
    A = H.detach().to(torch.float32, copy=not overwrite)
    dead = torch.diag(A) == 0
    A[dead, dead] = 1.0
    if perm is not None:
        permute_symmetric_(A, perm)
    A.diagonal().add_(damp * torch.mean(torch.diag(A)))
    mirror_lower_(A)  # symmetric, so the column-major view A.mT holds the same matrix
    info = torch.zeros((), dtype=torch.int32, device=A.device)
    with one_thread():  # LAPACK splits its blocks by thread count, and the last bits follow: one order, always
        torch.linalg.cholesky_ex(A.mT, out=(A.mT, info))  # L, column-major
        if info == 0:
            torch.cholesky_inverse(A.mT, out=A.mT)  # (P H Pᵀ + λI)⁻¹
            torch.linalg.cholesky_ex(A.mT, upper=True, out=(A.mT, info))
    if info == 0:
        return A.mT
    raise GeminiError(f"the Hessian is not positive definite even after dampening by {damp}; "
                      "raise damp (e.g. 0.1) or use more calibration tokens")


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU thread count set to 1 inside, restored after: for the CPU LAPACK calls whose results follow
    the thread count (the Cholesky factor and inverse: their blocked algorithms split by threads), so that
    `--threads 1` and `--threads 2` give the same bytes (issue #34). A GPU's solvers do not read it."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
