"""One-pass sequential calibration of a decoder layer.

GPTQ's true-sequential order (and SparseGPT's, and Wanda's) solves the groups of linears of a layer one
after another, each from inputs that already went through the solved groups before it. Done naively
that re-runs the layer once per group (q/k/v, then o, then gate/up, then down: about three layer
passes plus one for the outputs). Here every calibration window runs through the layer exactly once:

- the windows run in batches, each batch in its own thread, but only one thread runs at a time (the
  caller hands the turn to one thread and waits until it pauses), so nothing runs in parallel and the
  math is the same as a plain loop over batches;
- a forward pre-hook on every member of a group hands its input to `observe(group, x)` and pauses the
  thread at the group's first member;
- once every batch is paused at that group, `solve(group)` runs (it quantizes or prunes the group's
  weights in place from the statistics of *all* windows), and the batches resume: each linear runs
  once, already solved, and the layer's outputs are those of the solved layer.

The price is memory: every batch's activations of this one layer are alive at the same time (about
windows · seq_len · (intermediate + 2·hidden) · 4 bytes at the MLP's down projection). Stages offer
the per-group passes (`layerwise.LayerJob.forward`) as the low-memory alternative.
"""

from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from geminicompress.errors import GeminiError


class _Abort(BaseException):
    """Unwinds a paused batch thread when the pass is abandoned (an error elsewhere)."""


class _Batch(threading.Thread):
    """Runs `fn()` under no_grad once told to start; pauses inside hooks until resumed."""

    def __init__(self, fn: Callable[[], torch.Tensor], done: queue.Queue) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.done = done  # the caller waits on it: this thread paused or finished
        self.turn = threading.Semaphore(0)
        self.paused_at: int | None = None
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.abort = False

    def run(self) -> None:
        self.turn.acquire()
        try:
            if not self.abort:
                with torch.no_grad():  # grad mode is per thread
                    self.result = self.fn()
        except _Abort:
            pass
        except BaseException as exc:  # handed to the caller's thread, which re-raises it
            self.error = exc
        finally:
            self.paused_at = None
            self.done.put(self)

    def pause(self, group: int) -> None:
        self.paused_at = group
        self.done.put(self)
        self.turn.acquire()
        if self.abort:
            raise _Abort


def one_pass(forward: Callable[[torch.Tensor], torch.Tensor], batches: Sequence[torch.Tensor],
             groups: Sequence[Sequence[nn.Module]], observe: Callable[[int, torch.Tensor], None],
             solve: Callable[[int], None]) -> list[torch.Tensor]:
    """Run `forward(batch)` for every batch once, solving each group just before its first use.

    groups: modules whose forward input is the same tensor (e.g. q/k/v); observe(g, x) receives that
    input of every batch; solve(g) is called once all batches reached group g. Groups may fire in any
    order, but the same order for every batch. Returns the forward results, one per batch.
    """
    done: queue.Queue = queue.Queue()
    solved: set[int] = set()

    def pre_hook(g: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        worker = threading.current_thread()
        if g in solved or not isinstance(worker, _Batch):
            return
        observe(g, args[0].detach())
        worker.pause(g)

    handles = [m.register_forward_pre_hook(partial(pre_hook, g)) for g, group in enumerate(groups) for m in group]
    workers = [_Batch(partial(forward, b), done) for b in batches]

    def turn(worker: _Batch) -> None:
        worker.turn.release()
        back = done.get()
        assert back is worker, "only one batch thread runs at a time"
        if worker.error is not None:
            raise worker.error

    try:
        for worker in workers:
            worker.start()
            turn(worker)
        while True:
            points = {w.paused_at for w in workers}
            if points == {None}:
                break
            if len(points) != 1:
                raise GeminiError("calibration batches took different paths through the layer; "
                                  "run with the per-group passes instead (--multi-pass)")
            g = points.pop()
            solve(g)
            solved.add(g)
            for worker in workers:
                turn(worker)
    finally:
        for handle in handles:
            handle.remove()
        for worker in workers:  # after an error: unwind the paused threads so none is left behind
            if worker.is_alive():
                worker.abort = True
                worker.turn.release()
        for worker in workers:
            if worker.ident is not None:
                worker.join()
    missing = set(range(len(groups))) - solved
    if missing:
        raise GeminiError(f"the layer's forward never used group(s) {sorted(missing)}; "
                          "run with the per-group passes instead (--multi-pass)")
    return [w.result for w in workers]
