"""Which blocks to cut, chosen greedily by measured repaired drift (iterative block pruning: BlockPruner,
Zhong et al. 2024; "Shortened LLaMA", Kim et al. 2024).

One block goes at a time. At each step every candidate block still kept (the first and last block always
stay) is removed in turn, the cut is repaired in closed form (repair.py: the block before each dropped run
refit towards the teacher's stream after it, fitted on the calibration walk, without `follow`), and the
held-out windows' perplexity is measured through the kept blocks and the head. The candidate with the least
drift goes; the search stops when `keep` blocks remain. Unlike the plan's fixed candidates (plan.py:
contiguous spans, the smallest-angle set), the set found can be any set, and each step is judged after
repair, the way the student will be built.

Cost: about (L - 2) + (L - 3) + ... repaired evaluations for n dropped blocks (the demo, 6 of 30: 153),
each one block's refit per dropped run plus the held-out windows from the first cut through the head.
`pool` bounds a step's candidates to the `pool` best of the step before (the first step tries all).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from geminicompress.distill.repair import RepairSpec
from geminicompress.distill.survey import Compute, Walk, mean_nll
from geminicompress.host.progress import NullProgress

if TYPE_CHECKING:
    from geminicompress.distill.plan import Plan


@dataclass
class GreedyStep:
    """One step of the search: the block removed, the drift after it, and every candidate's drift."""

    block: int
    drift: float
    dropped: list[int]  # every block dropped after this step, sorted
    tried: dict[int, float]  # candidate block -> held-out drift after repair


def repaired_drift(model: nn.Module, dropped: list[int], fit: Walk, held: Walk, held_windows: torch.Tensor,
                   spec: RepairSpec, teacher_nll: float, *, on: Compute = Compute()) -> float:
    """Held-out drift (ppl_student / ppl_teacher - 1) of the student without blocks `dropped`, repaired."""
    from geminicompress.distill.plan import drift_of, measured_nll, repaired_layers

    kept = [i for i in range(fit.n_layers) if i not in set(dropped)]
    layers = None if spec.mode == "none" else repaired_layers(model, kept, fit, spec, on=on)[0]
    return drift_of(measured_nll(model, kept, held, held_windows, layers=layers, device=on.device, batch=on.batch),
                    teacher_nll)


def greedy_cut(model: nn.Module, keep: int, fit: Walk, held: Walk, held_windows: torch.Tensor, spec: RepairSpec, *,
               pool: int | None = None, on: Compute = Compute()) -> list[GreedyStep]:
    """Remove blocks one at a time, each the one whose removal (repaired) costs the least held-out drift,
    until `keep` of the L blocks remain (first and last kept). Returns the steps in order."""
    progress = on.progress or NullProgress()
    n_layers = fit.n_layers
    if not 2 <= keep < n_layers:
        raise ValueError(f"greedy search keeps 2..{n_layers - 1} blocks, not {keep}")
    quick = replace(spec, follow=False)  # the map at each cut only: one block refit per dropped run
    teacher_nll = mean_nll(model, held.hidden[-1], held_windows, device=on.device)
    dropped: list[int] = []
    order = list(range(1, n_layers - 1))
    steps: list[GreedyStep] = []
    for step in range(n_layers - keep):
        tried: dict[int, float] = {}
        pool_now = order if pool is None or step == 0 else order[:pool]
        with progress.task(f"greedy cut: step {step + 1} of {n_layers - keep}", len(pool_now)) as bar:
            for c in pool_now:
                tried[c] = repaired_drift(model, sorted([*dropped, c]), fit, held, held_windows, quick, teacher_nll,
                                          on=Compute(on.device, on.batch))
                bar.advance(1, block=c, drift=tried[c])
        best = min(tried, key=lambda c: (tried[c], c))
        dropped = sorted([*dropped, best])
        steps.append(GreedyStep(best, tried[best], dropped, tried))
        ranked = sorted(tried, key=lambda c: (tried[c], c))
        order = [c for c in ranked if c != best] + [c for c in order if c not in tried]
    return steps


def add_greedy(plan: "Plan", model: nn.Module, fit: Walk, held: Walk, held_windows: torch.Tensor, spec: RepairSpec, *,
               pool: int | None = None, on: Compute = Compute()) -> None:
    """Run the greedy search beside the plan's fixed candidates: its set joins them as kind "greedy" (drift
    measured unrepaired and repaired), its steps go to plan.greedy, and the plan's choice is again the
    candidate with the least repaired drift."""
    from geminicompress.core.arch import decoder_layers
    from geminicompress.distill.plan import Candidate, block_params, choose, drift_of, measured_nll
    from geminicompress.distill.survey import span_distances

    steps = greedy_cut(model, plan.keep, fit, held, held_windows, spec, pool=pool, on=on)
    plan.greedy = [asdict(s) for s in steps]
    dropped = steps[-1].dropped
    known = next((c for c in plan.candidates if c.dropped == dropped), None)
    if known is None:
        params = block_params(decoder_layers(model))
        single = span_distances(fit, 1)
        known = Candidate(dropped, "greedy", round(sum(single[b] for b in dropped), 6), sum(params[b] for b in dropped),
                          n_layers=plan.n_layers)
        known.drift = drift_of(measured_nll(model, known.kept, held, held_windows, device=on.device, batch=on.batch),
                               math.log(plan.teacher_ppl))
        plan.candidates.append(known)
    if spec.mode != "none":
        known.repaired_drift = steps[-1].drift
    choose(plan.candidates, spec.mode != "none")
