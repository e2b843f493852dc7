"""How many torch threads to use, so that a busy machine slows work down gracefully, not 30-fold.

torch's default is one intra-op thread per physical core. Its OpenMP threads meet at a barrier after
every parallel region (every matmul), so each region runs at the pace of the slowest thread. When
another process keeps one of the cores busy, the thread sharing that core gets half of it (or less)
and every other thread spins or sleeps at the barrier waiting for it: on a 2-core machine with one
CPU-bound process beside it, a demo-model decode step took 359 ms with 2 threads against 92 ms with
one thread (README, eval benchmark; the quickstart reported a TPOT of 1,940 ms instead of 51 ms).

So the default (`--threads` not given, no `threads:` in the recipe) is the number of cores that are
free when the command starts: the cores this process may run on (CPU affinity, cgroup quota), minus
the cores other processes kept busy over a short sample, at most torch's own default and at least 1.
On a quiet machine that is torch's default; with one busy core out of two it is 1.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

SAMPLE_S = 0.25  # how long `free_cores` watches the other processes


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # "--threads", "recipe" or "auto"
    reason: str  # one line for the user


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cpus = affinity()
    cores = len(cpus) if cpus is not None else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def busy_seconds(cpus: list[int] | None = None) -> float:
    """CPU seconds spent not idle, summed over `cpus` (all when None), since boot (/proc/stat)."""
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = [per_cpu[i] for i in cpus if i < len(per_cpu)] if cpus else per_cpu
    return sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) for t in chosen)


def own_seconds() -> float:
    """CPU seconds used by this process (all its threads) and its finished children."""
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def affinity() -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def other_busy_cores(seconds: float = SAMPLE_S) -> float:
    """How many of our cores other processes kept busy, on average, over the next `seconds`."""
    cpus = affinity()
    b0, o0, t0 = busy_seconds(cpus), own_seconds(), time.perf_counter()
    time.sleep(seconds)
    b1, o1, t1 = busy_seconds(cpus), own_seconds(), time.perf_counter()
    # /proc/stat counts in ticks read at other instants than the clock: on a loaded machine a short sample can
    # read more than all our cores; no process keeps more than them busy
    return min(float(len(cpus) if cpus else usable_cores()), max(0.0, ((b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-9)))


def auto_threads(torch_default: int, cores: int, others: float, load_1m: float | None) -> tuple[int, str]:
    """Free cores = cores - busy ones, where a core is busy when other processes used at least half of it.
    `others` (sampled now) is capped by the 1-minute load average so that a short burst does not count."""
    busy = min(others, load_1m) if load_1m is not None else others
    free = cores - int(busy + 0.5)
    threads = max(1, min(torch_default, free))
    if threads < torch_default:
        return threads, (f"{_n(threads)}: other processes kept {busy:.1f} of {cores} cores busy at the start "
                         "(--threads N to override)")
    return threads, f"{_n(threads)} (one per free core)"


def _n(threads: int) -> str:
    return f"{threads} torch thread{'s' if threads != 1 else ''}"


def torch_default_threads() -> int:
    """torch's own default: one thread per physical core (of those this process may use)."""
    return max(1, min(psutil.cpu_count(logical=False) or os.cpu_count() or 1, usable_cores()))


def choose_threads(cli: int | None = None, recipe: int | None = None, resumed: int | None = None) -> ThreadChoice:
    """`--threads` first, then the recipe's `threads:`, then the thread count of the interrupted run this one
    resumes (`resumed`: the same bytes need the same count, docs/streaming.md), else `auto_threads` from a
    short sample."""
    for given, source, why in ((cli, "--threads", "--threads"), (recipe, "recipe", "recipe key threads"),
                               (resumed, "resume", "as the interrupted run it resumes")):
        if given is not None:
            return ThreadChoice(given, source, f"{_n(given)} ({why})")
    n, reason = auto_threads(torch_default_threads(), usable_cores(), other_busy_cores(), load_average())
    return ThreadChoice(n, "auto", reason)


def load_average() -> float | None:
    """The system's 1-minute load average, None where it gives none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def apply_threads(n: int) -> None:
    """torch intra-op threads = n; inter-op threads too where torch still allows setting them."""
    import torch

    torch.set_num_threads(n)
    with suppress(RuntimeError):  # only settable once, before any inter-op work has run
        torch.set_num_interop_threads(n)


@contextmanager
def solver_threads(device) -> Iterator[None]:
    """One CPU thread for a column-by-column solver written in torch ops (SparseGPT): its loop is thousands of
    ops on (out,)-sized vectors, where a second thread only adds synchronisation (measured: 0.25 s vs 6 s
    for a 1536x576 weight on a busy 2-core machine). GPUs are unaffected. (GPTQ's column loop runs on
    numpy on the CPU and needs no such limit: gptq/solver.py.)"""
    import torch

    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
