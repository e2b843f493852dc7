"""Allocate one setting per module under a budget: a multiple-choice knapsack over a sensitivity table.

A table has one row per *unit* (a module, or a group of modules that must share a setting, such as
q/k/v fused by a serving engine) and one column per *option* (gptq 3-bit g64, 50% sparsity, ...).
`cost[i, j]` is what option j costs on unit i (bits, bytes or kept weights: anything additive) and
`drift[i, j]` its predicted damage (the KL to the original model at the output when option j is applied
to unit i alone). Drifts are taken as additive over units (first order: small independent perturbations
of the logits add up in KL), so choosing the options is

    minimise Σ_i drift[i, c_i]   subject to   Σ_i cost[i, c_i] ≤ budget,

the multiple-choice knapsack. Two solvers:
- `allocate` (exact up to the cost grid): dynamic programming over the budget discretised into
  `resolution` steps, each unit's costs rounded *up* onto the grid, so the budget is always met in true
  cost; with integer costs and budget (and a grid that fits) it is exact. The last DP row is the best
  drift for every budget at once: the drift-vs-cost frontier (`frontier`).
- `allocate_greedy`: start from each unit's least-drift option and repeatedly take the cheaper move with
  the least extra drift per unit of cost saved, until the budget is met (the LP-relaxation greedy).
`allocate_within_drift` answers the dual (the cheapest allocation whose predicted drift stays under a
limit) from the same frontier. A budget outside the reachable range raises `InputError` naming the range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from geminicompress.core.errors import InputError

MAX_STEPS = 200_000  # cap on the DP grid (n_units x steps int16 back-pointers)


@dataclass(frozen=True)
class Allocation:
    choice: tuple[int, ...]  # option index per unit
    cost: float
    drift: float


def _check(cost: np.ndarray, drift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cost = np.asarray(cost, dtype=np.float64)
    drift = np.asarray(drift, dtype=np.float64)
    if cost.ndim != 2 or cost.shape != drift.shape or cost.shape[0] == 0 or cost.shape[1] == 0:
        raise ValueError(f"cost and drift must be (units, options) arrays of one shape, got {cost.shape} and {drift.shape}")
    if not np.isfinite(cost).all():
        raise ValueError("costs must be finite")
    drift = np.where(np.isnan(drift), np.inf, drift)  # an option that does not apply to a unit
    if not np.isfinite(drift).any(axis=1).all():
        raise ValueError("every unit needs at least one applicable option")
    return cost, drift


def reachable(cost: np.ndarray, drift: np.ndarray | None = None) -> tuple[float, float]:
    """(cheapest, dearest) total cost over the applicable options."""
    cost = np.asarray(cost, dtype=np.float64)
    ok = np.ones_like(cost, bool) if drift is None else np.isfinite(np.where(np.isnan(drift), np.inf, drift))
    return float(np.where(ok, cost, np.inf).min(1).sum()), float(np.where(ok, cost, -np.inf).max(1).sum())


def check_budget(cost: np.ndarray, drift: np.ndarray, budget: float, what: str = "budget",
                 show=lambda v: f"{v:g}") -> None:
    """InputError unless `budget` lies in the reachable range (a target beyond the dearest choice is
    not a target either: nothing would spend it)."""
    lo, hi = reachable(cost, drift)
    tol = 1e-9 * max(1.0, abs(hi))
    if not lo - tol <= budget <= hi + tol:
        raise InputError(f"{what} {show(budget)} cannot be met with these options: "
                         f"the reachable range is {show(lo)} to {show(hi)}")


def _total(cost: np.ndarray, drift: np.ndarray, choice: list[int]) -> Allocation:
    rows = np.arange(len(choice))
    return Allocation(tuple(int(c) for c in choice), float(cost[rows, choice].sum()), float(drift[rows, choice].sum()))


def _grid(cost: np.ndarray, budget: float, resolution: int) -> tuple[np.ndarray, int, float]:
    """Integer costs above each unit's cheapest option, rounded up, and the integer budget."""
    base = cost.min(1, keepdims=True)
    extra = cost - base  # (n, k) >= 0
    spare = budget - float(base.sum())
    integral = np.allclose(cost, np.round(cost)) and float(budget).is_integer() and spare <= MAX_STEPS
    if integral:
        return np.round(extra).astype(np.int64), int(round(spare)), 1.0
    step = max(spare, float(extra.max(1).sum()) * 1e-9, 1e-300) / resolution
    units = np.ceil(extra / step - 1e-9).astype(np.int64)
    return units, int(math.floor(spare / step + 1e-9)), step


def _dp(units: np.ndarray, drift: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """best[b] = least total drift with Σ units ≤ b, for b in 0..steps; back[i, b] = unit i's option."""
    n, k = units.shape
    best = np.zeros(steps + 1)
    back = np.zeros((n, steps + 1), dtype=np.int16)
    for i in range(n):
        new = np.full(steps + 1, np.inf)
        arg = np.zeros(steps + 1, dtype=np.int16)
        for j in range(k):
            c, d = int(units[i, j]), drift[i, j]
            if c > steps or not np.isfinite(d):
                continue
            cand = np.full(steps + 1, np.inf)
            cand[c:] = best[:steps + 1 - c] + d
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        best, back[i] = new, arg
    return best, back


def _trace(units: np.ndarray, back: np.ndarray, b: int) -> list[int]:
    choice = []
    for i in range(units.shape[0] - 1, -1, -1):
        j = int(back[i, b])
        choice.append(j)
        b -= int(units[i, j])
    return choice[::-1]


def allocate(cost: np.ndarray, drift: np.ndarray, budget: float, resolution: int = 4096) -> Allocation:
    """The least-drift choice of one option per unit with total cost ≤ budget (DP, exact on the cost grid)."""
    cost, drift = _check(cost, drift)
    check_budget(cost, drift, budget)
    units, steps, _ = _grid(cost, budget, resolution)
    best, back = _dp(units, drift, steps)
    if not np.isfinite(best[steps]):  # rounding up pushed the cheapest choice over: fall back to it
        return _total(cost, drift, list(np.where(np.isfinite(drift), cost, np.inf).argmin(1)))
    return _total(cost, drift, _trace(units, back, steps))


def allocate_greedy(cost: np.ndarray, drift: np.ndarray, budget: float) -> Allocation:
    """From each unit's least-drift option, take the cheaper move with the least added drift per unit of
    cost saved until the total cost is within budget."""
    cost, drift = _check(cost, drift)
    check_budget(cost, drift, budget)
    choice = [int(np.argmin(np.where(np.isfinite(d), d - 1e-12 * c, np.inf))) for c, d in zip(cost, drift)]
    total = sum(cost[i, c] for i, c in enumerate(choice))
    while total > budget + 1e-9 * max(1.0, abs(budget)):
        best, move = math.inf, None
        for i, c in enumerate(choice):
            saved = cost[i, c] - cost[i]  # (k,)
            added = drift[i] - drift[i, c]
            for j in np.flatnonzero((saved > 0) & np.isfinite(drift[i])):
                rate = added[j] / saved[j]
                if rate < best:
                    best, move = rate, (i, int(j))
        assert move is not None, "check_budget guarantees a cheaper move while over budget"
        i, j = move
        total -= cost[i, choice[i]] - cost[i, j]
        choice[i] = j
    return _total(cost, drift, choice)


def frontier(cost: np.ndarray, drift: np.ndarray, resolution: int = 512) -> list[tuple[float, float]]:
    """(budget, least predicted drift) at `resolution` budgets over the reachable range: the whole curve
    of one DP over the dearest budget."""
    cost, drift = _check(cost, drift)
    lo, hi = reachable(cost, drift)
    units, steps, step = _grid(cost, hi, resolution)
    best, _ = _dp(units, drift, steps)
    return [(lo + b * step, float(best[b])) for b in range(steps + 1) if np.isfinite(best[b])]


def allocate_within_drift(cost: np.ndarray, drift: np.ndarray, max_drift: float,
                          resolution: int = 4096) -> Allocation:
    """The cheapest allocation (on the cost grid) whose total drift is at most `max_drift`."""
    cost, drift = _check(cost, drift)
    lo, hi = reachable(cost, drift)
    least = float(np.where(np.isfinite(drift), drift, np.inf).min(1).sum())
    if max_drift < least:
        raise InputError(f"a drift of at most {max_drift:g} cannot be met with these options: "
                         f"the reachable range is {least:g} (dearest choice) and up")
    units, steps, step = _grid(cost, hi, resolution)
    best, back = _dp(units, drift, steps)
    b = int(np.flatnonzero(best <= max_drift + 1e-12)[0])
    return _total(cost, drift, _trace(units, back, b))
