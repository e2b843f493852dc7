"""The stacking rule of the serving table, and the load its timed rows run at. Pure: figures in, decisions out.

Each row adds its optimization to the best configuration measured above it (the stack), never to a row that
lost. The rule, one for every row:

    a row joins the stack when, in the capacity pass (a burst: every request at once), it serves more requests
    per second than the stack, and at least SAME_ANSWERS of its greedy answer tokens equal the stack's
    (greedy decoding: the rest are float ties).

A row that is slower is marked `lost`, one that changes answers (prompt truncation, INT8/INT4 weights, a
student in place of its teacher) `trade`; both are shown with their figures and left out of the stack, so
the next row is added to the same best configuration. The first measured row is the stack to begin with.

The timed rows then run at one load: a share (default 0.7) of the final stack's capacity, or a rate the
user gives (`--rate`), the same for every row, so that TTFT under load says what a user waits at a load
the best server holds (rows slower than the load queue, and are marked overloaded); or as a closed loop of
N clients (`--concurrency N`: each sends its next request when its answer is done).
"""

from __future__ import annotations

from dataclasses import dataclass

SAME_ANSWERS = 0.99  # share of answer tokens equal to the stack's for "equal answers" (the rest: float ties)
DEFAULT_LOAD = 0.7  # the timed rows' arrival rate as a share of the stack's capacity


@dataclass(frozen=True)
class Verdict:
    joins: bool  # the row becomes the new stack
    mark: str  # "stack" (the first row), "stacked", "lost", "trade"
    speedup: float | None  # its capacity / the stack's


def verdict(capacity: float | None, stack_capacity: float | None, agreement: float | None) -> Verdict:
    """Whether a measured row joins the stack: faster than the stack at equal answers (module docstring).
    `stack_capacity` None: this is the first measured row, the stack to begin with."""
    if stack_capacity is None:
        return Verdict(True, "stack", None)
    speedup = None if not capacity or not stack_capacity else capacity / stack_capacity
    if speedup is None or speedup <= 1.0:
        return Verdict(False, "lost", speedup)
    if agreement is None or agreement < SAME_ANSWERS:
        return Verdict(False, "trade", speedup)
    return Verdict(True, "stacked", speedup)


def stacked(flags: dict, change: dict) -> dict:
    """A row's configuration: the stack's flags with the row's own change on top."""
    return {**flags, **change}


@dataclass(frozen=True)
class Load:
    """How the timed rows are loaded: one of a share of the stack's capacity, a rate, or a closed loop."""

    share: float | None = DEFAULT_LOAD
    rate: float | None = None  # requests/s, instead of the share
    concurrency: int | None = None  # clients in a closed loop, instead of arrivals at a rate


def closed_loop_note(concurrency: int) -> str:
    return f"{concurrency} clients in a closed loop (each sends its next request when its answer is done)"


def load_rate(capacity: float | None, share: float | None, rate: float | None) -> tuple[float, str]:
    """(arrival rate in requests/s, how it was chosen) of the timed rows: `rate` when given (`--rate`), else
    `share` of the stack's `capacity`."""
    if rate is not None:
        return rate, f"{rate:g} req/s (--rate)"
    if not capacity or share is None:
        raise ValueError("a load share needs the stack's measured capacity")
    return capacity * share, f"{share:g} x the stack's capacity {capacity:.3g} req/s = {capacity * share:.3g} req/s"


def overloaded(capacity: float | None, rate: float) -> bool:
    """A row whose capacity is below the arrival rate cannot hold the load: its queue grows, TTFT is queueing."""
    return capacity is not None and rate > capacity


def tpot_ratio(tpot_ms: float | None, reference_ms: float | None) -> float | None:
    """A row's TPOT against a reference row's (student vs teacher's stack, speculative vs verifier alone)."""
    if not tpot_ms or not reference_ms:
        return None
    return tpot_ms / reference_ms
