"""Several stages' LayerFns as one: every stage is applied to decoder layer i before layer i+1 (a streamed
multi-stage recipe), and the calibration passes of consecutive group-sequential stages are one pass.

`compose(*fns)` runs the stages in order on the same layer, each seeing the layer as the stages before it
left it. Consecutive stages wrapped in `OnePassFn` (their LayerFn's only use of the layer's activations
is one `job.one_pass` call, and they change the layer only inside its `solve`: SparseGPT/Wanda and GPTQ
with true-sequential) share that pass: the windows run through the layer once; before group g computes,
every stage solves its part of g in stage order (e.g. SparseGPT prunes, then GPTQ quantizes what it
left), and every stage's statistics come from the same inputs, those through the groups all stages
already solved (llm-compressor's sequential pipeline likewise calibrates every modifier of a subgraph in
one forward). The layer's outputs of that pass feed the next layer.

How, without changing the stages: each stage's LayerFn runs in its own greenlet (onepass.py says why
greenlets, not threads) with a job whose `one_pass` hands (groups, observe, solve) to the composer and
pauses. Once every stage is paused there, the composer runs the real `one_pass` with the callbacks
merged, then resumes the stages, which return their summaries and kept tensors as after their own pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from greenlet import getcurrent, greenlet

from geminicompress.engine.layers import BATCH_WINDOWS, LayerFn, LayerJob

_PAUSED = object()


@dataclass(frozen=True)
class OnePassFn:
    """A LayerFn that uses the layer's activations through exactly one `job.one_pass` call and changes
    the layer only inside that call's `solve`: consecutive ones share one pass (`compose`)."""

    fn: LayerFn

    def __call__(self, job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self.fn(job)


def compose(*fns: LayerFn) -> LayerFn:
    """One LayerFn running `fns` in order on the same layer (consecutive `OnePassFn`s in one pass).
    Summaries and kept tensors are keyed by stage position ("0.sparsity") when there are several."""
    if len(fns) == 1:
        return fns[0]

    def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        summary: dict[str, Any] = {}
        kept: dict[str, torch.Tensor] = {}
        for first, run in _runs(fns):
            job.output_batches = None  # a later stage changes the layer: earlier one-pass outputs are stale
            results = [run[0](job)] if len(run) == 1 else _one_pass_together(job, run)
            for k, (s, t) in enumerate(results, start=first):
                summary.update({f"{k}.{key}": v for key, v in s.items()})
                kept.update({f"{k}.{key}": v for key, v in t.items()})
        return summary, kept

    return process


def _runs(fns: tuple[LayerFn, ...]) -> list[tuple[int, list[LayerFn]]]:
    """(index of the first, the stages) of each maximal run of consecutive OnePassFns; other stages alone."""
    runs: list[tuple[int, list[LayerFn]]] = []
    for k, fn in enumerate(fns):
        if runs and isinstance(fn, OnePassFn) and all(isinstance(f, OnePassFn) for f in runs[-1][1]):
            runs[-1][1].append(fn)
        else:
            runs.append((k, [fn]))
    return runs


class _PausingJob:
    """The job a stage sees inside `_one_pass_together`: `one_pass` records the call and pauses the stage."""

    def __init__(self, job: LayerJob) -> None:
        self._job = job
        self.call: tuple[list[list[str]], Callable, Callable, int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def one_pass(self, groups: list[list[str]], observe: Callable[[int, torch.Tensor], None],
                 solve: Callable[[int], None], batch: int = BATCH_WINDOWS) -> None:
        assert self.call is None, "a OnePassFn calls job.one_pass once"
        self.call = (groups, observe, solve, batch)
        getcurrent().parent.switch(_PAUSED)  # resumed once the shared pass is done


def _one_pass_together(job: LayerJob, fns: list[LayerFn]) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    jobs = [_PausingJob(job) for _ in fns]
    stages = [greenlet(partial(fn, j)) for fn, j in zip(fns, jobs)]
    results: list[Any] = [None] * len(fns)
    try:
        with torch.no_grad():
            for k, g in enumerate(stages):
                out = g.switch()  # runs stage k until its one_pass call (or to its end)
                if out is not _PAUSED:
                    results[k] = out
            calls = [(k, j.call) for k, j in enumerate(jobs) if results[k] is None]
            if calls:
                assert len({c[3] for _, c in calls}) == 1, "stages sharing a pass use one batch size"
                groups, owners = _merge([c[0] for _, c in calls])

                def observe(g: int, x: torch.Tensor) -> None:
                    for s, i in owners[g]:
                        calls[s][1][1](i, x)

                def solve(g: int) -> None:
                    for s, i in owners[g]:  # in stage order
                        calls[s][1][2](i)

                job.one_pass(groups, observe, solve, calls[0][1][3])
            # resume the paused stages last-paused first: their `with torch.no_grad()` blocks then exit in
            # the reverse order of entry, so the thread's grad mode is restored as it was
            for k, _ in reversed(calls):
                results[k] = stages[k].switch()
    finally:
        for g in stages:  # after an error: unwind the paused stages so none is left behind
            if g:
                g.throw()
    return results


def _merge(stage_groups: list[list[list[str]]]) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """Union of the stages' groups (a group: linears reading one input; groups sharing a linear merge).
    Returns (merged groups, per merged group the (stage, its group index) pairs in stage order)."""
    merged: list[list[str]] = []
    owners: list[list[tuple[int, int]]] = []
    for s, groups in enumerate(stage_groups):
        for i, group in enumerate(groups):
            hit = next((m for m, names in enumerate(merged) if set(names) & set(group)), None)
            if hit is None:
                merged.append(list(group))
                owners.append([(s, i)])
            else:
                merged[hit] += [n for n in group if n not in merged[hit]]
                owners[hit].append((s, i))
    return merged, owners
