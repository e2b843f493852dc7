"""One-pass sequential calibration of a decoder layer.

GPTQ's true-sequential order (and SparseGPT's, and Wanda's) solves the groups of linears of a layer one
after another, each from inputs that already went through the solved groups before it. Done naively
that re-runs the layer once per group (q/k/v, then o, then gate/up, then down: about three layer
passes plus one for the outputs). Here every calibration window runs through the layer exactly once:

- the windows run in batches, each batch's forward in its own greenlet (a paused call stack on the same
  OS thread): the driver switches to one batch at a time and gets control back when it pauses, so
  nothing runs in parallel and the math is the same as a plain loop over batches;
- a forward pre-hook on every member of a group hands its input to `observe(group, x)` and pauses the
  batch at the group's first member;
- once every batch is paused at that group, `solve(group)` runs (it quantizes or prunes the group's
  weights in place from the statistics of *all* windows), and the batches resume: each linear runs
  once, already solved, and the layer's outputs are those of the solved layer.

Why greenlets and not threads: every OS thread that runs a parallel torch op gets its own OpenMP team, and
with more of them than CPUs every small parallel op pays a futex wake-up (measured: docs/gptq.md, "Why
greenlets, not threads"). Greenlets keep a single thread; torch's grad mode is per thread, so it is set
once around the whole pass.

The price is memory: every batch's activations of this one layer are alive at the same time (about
windows · seq_len · (intermediate + 2·hidden) · 4 bytes at the MLP's down projection). Stages offer
the per-group passes (`layers.LayerJob.forward`) as the low-memory alternative.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from greenlet import getcurrent, greenlet

from geminicompress.core.errors import GeminiError

_FINISHED = -1


def one_pass(forward: Callable[[torch.Tensor], torch.Tensor], batches: Sequence[torch.Tensor],
             groups: Sequence[Sequence[nn.Module]], observe: Callable[[int, torch.Tensor], None],
             solve: Callable[[int], None]) -> list[torch.Tensor]:
    """Run `forward(batch)` for every batch once, solving each group just before its first use.

    groups: modules whose forward input is the same tensor (e.g. q/k/v); observe(g, x) receives that
    input of every batch; solve(g) is called once all batches reached group g. Groups may fire in any
    order, but the same order for every batch. Returns the forward results, one per batch.
    """
    solved: set[int] = set()
    results: list[torch.Tensor | None] = [None] * len(batches)
    driver = getcurrent()
    workers: dict[greenlet, int] = {}

    def pre_hook(g: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        me = getcurrent()
        if g in solved or me not in workers:
            return
        observe(g, args[0].detach())
        driver.switch(g)  # pause here; the driver resumes this batch once group g is solved

    def run(i: int) -> int:
        results[i] = forward(batches[i])
        return _FINISHED

    handles = [m.register_forward_pre_hook(partial(pre_hook, g)) for g, group in enumerate(groups) for m in group]
    batch_runs = [greenlet(partial(run, i), parent=driver) for i in range(len(batches))]
    workers.update({w: i for i, w in enumerate(batch_runs)})
    try:
        with torch.no_grad():
            points = {w.switch() for w in batch_runs}  # each runs until it pauses at a group (or ends)
            while points != {_FINISHED}:
                if len(points) != 1:
                    raise GeminiError("calibration batches took different paths through the layer; "
                                      "run with the per-group passes instead (--multi-pass)")
                g = points.pop()
                solve(g)
                solved.add(g)
                points = {w.switch() for w in batch_runs}
    finally:
        for handle in handles:
            handle.remove()
        for w in batch_runs:  # after an error: unwind the paused batches so none is left behind
            if w:
                w.throw()
    missing = set(range(len(groups))) - solved
    if missing:
        raise GeminiError(f"the layer's forward never used group(s) {sorted(missing)}; "
                          "run with the per-group passes instead (--multi-pass)")
    return results  # type: ignore[return-value]
