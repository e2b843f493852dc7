"""Was the machine busy while we timed? Timings on a shared CPU can be off 30-fold without a sign.

Around each timed section `latency` takes a `Reading` before and after: the CPU seconds spent on our
cores by everything (/proc/stat, via psutil), those spent by this process, the wall clock and the
1-minute load average. Their difference gives how many cores *other* processes kept busy meanwhile:

    other_cores = (Δ busy CPU seconds on our cores − Δ this process's CPU seconds) / Δ wall seconds

`assess` turns that, and the spread of the timed runs (p90 / median), into a verdict: timings are
unreliable when the cores were oversubscribed (our threads + other_cores > cores + 1/4), when other
processes used at least max(1/2, cores/4) cores, or when a p90 is ≥ 1.25× its median.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

BUSY_MIN_CORES = 0.5  # other processes using this many cores (or a quarter of them) make timings suspect
OVERSUBSCRIBED_SLACK = 0.25
SPREAD_LIMIT = 1.25  # p90 / median above this: the timed runs disagree


@dataclass(frozen=True)
class Reading:
    wall: float  # time.perf_counter()
    busy: float  # CPU seconds not idle on our cores, all processes, since boot
    own: float  # CPU seconds of this process (all threads) and its finished children
    load_1m: float | None


def read() -> Reading:
    """A reading now (cheap: two /proc reads)."""
    from geminicompress.host.threads import affinity, busy_seconds, load_average, own_seconds

    return Reading(time.perf_counter(), busy_seconds(affinity()), own_seconds(), load_average())


def between(before: Reading, after: Reading) -> dict:
    """{seconds, other_cores, load_1m} over one timed section."""
    wall = max(after.wall - before.wall, 1e-9)
    other = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall
    loads = [x for x in (before.load_1m, after.load_1m) if x is not None]
    return {"seconds": round(wall, 3), "other_cores": round(other, 3),
            "load_1m": round(max(loads), 2) if loads else None}


def spread(summary: dict | None) -> float | None:
    """p90 / median of a {median, p90} summary."""
    if not summary or not summary.get("median"):
        return None
    return summary["p90"] / summary["median"]


def assess(sections: dict[str, dict], spreads: dict[str, float | None], cores: int, threads: int) -> dict:
    """Verdict on the timed sections: {other_cores, load_1m, cores, threads, spread, unreliable, why, fix}."""
    other = max((s["other_cores"] for s in sections.values()), default=0.0)
    loads = [s["load_1m"] for s in sections.values() if s.get("load_1m") is not None]
    load = max(loads) if loads else None
    worst_name, worst = max(((k, v) for k, v in spreads.items() if v is not None), key=lambda kv: kv[1],
                            default=(None, None))
    oversubscribed = threads + other > cores + OVERSUBSCRIBED_SLACK
    busy = other >= max(BUSY_MIN_CORES, cores / 4)
    why, fix = [], None
    if oversubscribed or busy:
        load_text = f", load average {load:.1f}" if load is not None else ""
        why.append(f"other processes used {other:.1f} of {cores} cores while timing with {threads} "
                   f"thread{'s' if threads > 1 else ''}{load_text}")
        free = max(1, cores - int(other + 0.5))
        fix = (f"rerun with --threads {free} or on a quiet machine" if oversubscribed and threads > free
               else "rerun on a quiet machine")
    if worst is not None and worst >= SPREAD_LIMIT:
        why.append(f"{worst_name} p90 is {worst:.2f}x its median")
        fix = fix or "rerun with more --repeats or on a quiet machine"
    return {"other_cores": round(other, 3), "load_1m": load, "cores": cores, "threads": threads,
            "spread": None if worst is None else round(worst, 3), "oversubscribed": oversubscribed,
            "unreliable": bool(why), "why": "; ".join(why) or None, "fix": fix}
