"""Time and memory of the GPTQ/SparseGPT inverse Hessian factor at an 8B model's down_proj width (14336):
the in-place factor (`compress/hessian.py`, one buffer) against the same computation in fresh buffers
(the reference, two to three buffers). Run alone (quiet machine); prints medians and writes JSON.

  /work/logs/quiet.sh python benchmarks/studies/memory/inverse_factor_bench.py --n 14336 --runs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from geminicompress.compress.hessian import inverse_hessian_factor

ROOT = Path(__file__).resolve().parents[3]


def fresh_buffers(H: torch.Tensor, damp: float, perm: torch.Tensor) -> torch.Tensor:
    """The reference: the permuted copy, then Cholesky, inverse and upper factor each in a new buffer."""
    A = H[perm][:, perm]
    dead = torch.diag(A) == 0
    A[dead, dead] = 1.0
    A.diagonal().add_(damp * torch.mean(torch.diag(A)))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(A)), upper=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2 * a.n, a.n, generator=g)
    H = X.t() @ X / a.n  # (n, n), symmetric positive definite
    del X
    perm = torch.argsort(torch.diag(H), descending=True)
    times: dict[str, list[float]] = {"in_place": [], "fresh_buffers": []}
    same = None
    for _ in range(a.runs):
        for name in times:
            A = H.clone()
            t = time.perf_counter()
            U = inverse_hessian_factor(A, 0.01, perm, overwrite=True) if name == "in_place" else fresh_buffers(A, 0.01, perm)
            times[name].append(time.perf_counter() - t)
            if name == "in_place":
                ref = fresh_buffers(H.clone(), 0.01, perm)
                same = bool(torch.equal(U, ref))
                del ref
            del A, U
    rows = {k: round(statistics.median(v), 2) for k, v in times.items()}
    print(f"n={a.n}: in place {rows['in_place']} s, fresh buffers {rows['fresh_buffers']} s (medians of {a.runs}); "
          f"bitwise equal: {same}; buffer {a.n * a.n * 4 / 1e6:.0f} MB")
    out = ROOT / "benchmarks" / "results" / f"inverse_factor_{a.n}.json"
    out.write_text(json.dumps({"n": a.n, "median_s": rows, "runs": times, "bitwise_equal": same}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
