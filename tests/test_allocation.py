"""The allocation knapsack against brute force on small hand-made tables."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from geminicompress.compress.allocation import allocate, allocate_greedy, allocate_within_drift, frontier, reachable
from geminicompress.core.errors import InputError


def brute(cost, drift, budget):
    cost, drift = np.asarray(cost, float), np.asarray(drift, float)
    best = None
    for choice in itertools.product(range(cost.shape[1]), repeat=cost.shape[0]):
        c = sum(cost[i, j] for i, j in enumerate(choice))
        d = sum(drift[i, j] for i, j in enumerate(choice))
        if c <= budget + 1e-9 and (best is None or d < best[1] - 1e-12):
            best = (c, d)
    return best


HAND = (  # 3 units x 3 options: (bits, drift)
    [[4, 3, 2], [8, 4, 3], [4, 3, 2]],
    [[0.0, 0.5, 2.0], [0.0, 0.1, 0.3], [0.0, 2.0, 3.0]],
)


def test_hand_table_known_answer():
    cost, drift = HAND
    a = allocate(cost, drift, 11)
    # 11 bits: unit 1 drops from 8 to 3 bits (drift 0.3), cheaper than 8 -> 4 plus unit 0 at 3 bits (0.6)
    assert a.choice == (0, 2, 0) and a.cost == 11 and a.drift == pytest.approx(0.3)


@pytest.mark.parametrize("seed", range(20))
def test_dp_matches_brute_force_integer(seed):
    rng = np.random.default_rng(seed)
    n, k = rng.integers(2, 6), rng.integers(2, 4)
    cost = rng.integers(1, 20, size=(n, k)).astype(float)
    drift = rng.random((n, k))
    lo, hi = reachable(cost)
    budget = float(rng.integers(int(lo), int(hi) + 1))
    a = allocate(cost, drift, budget)
    c, d = brute(cost, drift, budget)
    assert a.cost <= budget
    assert a.drift == pytest.approx(d, abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_dp_fractional_costs_meet_budget_and_are_near_optimal(seed):
    rng = np.random.default_rng(100 + seed)
    cost = rng.random((5, 3)) * 10
    drift = rng.random((5, 3))
    lo, hi = reachable(cost)
    budget = lo + rng.random() * (hi - lo)
    a = allocate(cost, drift, budget, resolution=100_000)
    assert a.cost <= budget + 1e-9
    assert a.drift == pytest.approx(brute(cost, drift, budget)[1], abs=1e-9) or a.drift >= brute(cost, drift, budget)[1]
    # optimal at a budget one grid step tighter: the rounding can only cost the last step
    assert a.drift <= brute(cost, drift, budget - (budget - lo) * 2e-4 * 5)[1] + 1e-12


@pytest.mark.parametrize("seed", range(10))
def test_greedy_meets_budget_and_is_never_better_than_optimal(seed):
    rng = np.random.default_rng(200 + seed)
    cost = rng.integers(1, 20, size=(4, 3)).astype(float)
    drift = rng.random((4, 3))
    lo, hi = reachable(cost)
    budget = float(rng.integers(int(lo), int(hi) + 1))
    g = allocate_greedy(cost, drift, budget)
    assert g.cost <= budget
    assert g.drift >= brute(cost, drift, budget)[1] - 1e-12


def test_greedy_optimal_on_convex_table():
    # drift convex in cost per unit: the greedy is optimal at the hull's vertices
    cost = [[4, 3, 2]] * 3
    drift = [[0.0, 0.1, 0.5], [0.0, 0.1, 0.3], [0.0, 0.05, 0.5]]
    for budget in range(6, 13):
        assert allocate_greedy(cost, drift, budget).drift == pytest.approx(brute(cost, drift, budget)[1])


def test_inapplicable_options_are_skipped():
    cost = [[4, 3], [4, 3]]
    drift = [[0.0, np.nan], [0.0, 1.0]]
    a = allocate(cost, drift, 7)
    assert a.choice == (0, 1)
    with pytest.raises(InputError, match="reachable range is 7 to 8"):
        allocate(cost, drift, 6)


def test_unreachable_budget_names_range():
    cost, drift = HAND
    with pytest.raises(InputError, match="reachable range is 7 to 16"):
        allocate(cost, drift, 6.5)
    with pytest.raises(InputError, match="reachable range"):
        allocate_greedy(cost, drift, 17)


def test_frontier_is_the_best_drift_per_budget():
    cost, drift = HAND
    curve = dict(frontier(cost, drift))
    for budget in range(7, 17):
        assert curve[float(budget)] == pytest.approx(brute(cost, drift, budget)[1])


def test_within_drift_is_the_cheapest_allocation_under_the_limit():
    cost, drift = HAND
    a = allocate_within_drift(cost, drift, 0.6)
    assert a.drift <= 0.6
    cheapest = min(sum(np.asarray(cost)[i, j] for i, j in enumerate(ch))
                   for ch in itertools.product(range(3), repeat=3)
                   if sum(np.asarray(drift)[i, j] for i, j in enumerate(ch)) <= 0.6)
    assert a.cost == cheapest
    with pytest.raises(InputError, match="reachable range"):
        allocate_within_drift(cost, drift, -1.0)
