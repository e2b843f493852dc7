"""Which blocks to cut, chosen by measurement: the candidate cuts and the plan table (plan.json).

For a student keeping `keep` of the teacher's L blocks (n = L - keep dropped), the candidates are
- every contiguous span of n blocks, first and last block kept (i = 1 .. L-1-n);
- the n blocks whose own angular distance d(h_b, h_{b+1}) is smallest (a non-contiguous set);
- the evenly spaced derivation (DistilBERT-style, student.keep_layers), for comparison.
Each is scored on the calibration walk (survey.py) by
1. its angular distance (spans: d(h_i, h_{i+n}); sets: the sum over their blocks);
2. its measured drift without repair: the held-out calibration windows' perplexity when the student skips
   the blocks (the teacher's stream at the first dropped boundary through the kept blocks after it and
   the head), against the teacher's;
3. for the `shortlist` best by (2): its measured drift after the closed-form repair at each cut (repair.py,
   the block before each dropped run refit, fitted on the calibration windows; without `follow`, so that a
   candidate costs one block's refit): the repaired drift is what a plan is chosen by (the best unrepaired
   cut is not always the best repaired one). The plan's prediction is the held-out drift of the student
   finally built (cut.planned_student, with the full repair).
Parameters saved are counted; decode time per token is measured for the teacher and the chosen student.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.arch import decoder_layers
from geminicompress.distill.repair import RepairSpec, boundaries_read, repair
from geminicompress.distill.student import keep_layers
from geminicompress.distill.survey import Compute, Walk, mean_nll, mlp_down, run_layers, span_distances
from geminicompress.host.progress import NullProgress


@dataclass
class Candidate:
    """One candidate cut: the teacher blocks it drops and what it costs."""

    dropped: list[int]
    kind: str  # "span", "angular-set", "even"
    angular: float
    params_saved: int
    drift: float | None = None  # measured, no repair: ppl_student / ppl_teacher - 1 on the held-out windows
    repaired_drift: float | None = None  # measured after the closed-form repair
    chosen: bool = False

    @property
    def kept(self) -> list[int]:
        return [i for i in range(self.n_layers) if i not in set(self.dropped)]

    n_layers: int = field(default=0, repr=False)


@dataclass
class Plan:
    """The plan table: the teacher's held-out perplexity, every candidate, the choice, decode times."""

    n_layers: int
    keep: int
    teacher_ppl: float
    candidates: list[Candidate]
    repair: dict[str, Any]
    fit_windows: int
    held_windows: int
    decode: dict[str, Any] = field(default_factory=dict)
    greedy: list[dict[str, Any]] = field(default_factory=list)  # the greedy search's steps (greedy.py), if run

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.chosen)

    def as_dict(self) -> dict[str, Any]:
        rows = [{**{k: v for k, v in asdict(c).items() if k != "n_layers"}, "kept": c.kept} for c in self.candidates]
        return {"n_layers": self.n_layers, "keep": self.keep, "teacher_ppl": round(self.teacher_ppl, 4),
                "fit_windows": self.fit_windows, "held_windows": self.held_windows, "repair": self.repair,
                "chosen": rows[self.candidates.index(self.chosen)], "predicted_drift": self.chosen.repaired_drift
                if self.chosen.repaired_drift is not None else self.chosen.drift,
                "decode": self.decode, "candidates": rows, **({"greedy": self.greedy} if self.greedy else {})}


def block_params(layers: nn.ModuleList) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def candidates(w: Walk, keep: int, params: list[int]) -> list[Candidate]:
    """Contiguous spans (first and last block kept), the smallest-angle set, and the even derivation."""
    L = w.n_layers
    n = L - keep
    out: list[Candidate] = []
    spans = span_distances(w, n)
    for i in range(1, L - n):
        out.append(Candidate(list(range(i, i + n)), "span", round(spans[i], 6), sum(params[i:i + n]), n_layers=L))
    single = span_distances(w, 1)
    inner = sorted(range(1, L - 1), key=lambda b: single[b])[:n]
    sets = {tuple(c.dropped) for c in out}
    if n <= L - 2 and tuple(sorted(inner)) not in sets:
        out.append(Candidate(sorted(inner), "angular-set", round(sum(single[b] for b in inner), 6),
                             sum(params[b] for b in inner), n_layers=L))
    even = [i for i in range(L) if i not in set(keep_layers(L, keep))]
    if tuple(even) not in {tuple(c.dropped) for c in out}:
        out.append(Candidate(even, "even", round(sum(single[b] for b in even), 6), sum(params[b] for b in even),
                             n_layers=L))
    return out


def drift_of(nll: float, teacher_nll: float) -> float:
    """Perplexity drift (ppl / teacher ppl - 1) from mean NLLs, as the plan records it."""
    return round(math.exp(nll - teacher_nll) - 1.0, 6)


def choose(cands: list[Candidate], repaired: bool) -> Candidate:
    """Mark the plan's choice among `cands` and return it: the least repaired drift (a candidate not repaired
    is never chosen) when the cut is repaired, else the least drift; the first in `cands`' order on a tie."""
    score = (lambda c: math.inf if c.repaired_drift is None else c.repaired_drift) if repaired else (lambda c: c.drift)
    for c in cands:
        c.chosen = False
    best = min(cands, key=score)
    best.chosen = True
    return best


@torch.no_grad()
def measured_nll(model: nn.Module, kept: list[int], held: Walk, windows: torch.Tensor, *,
                 layers: list[nn.Module] | None = None, device: torch.device, batch: int = 4) -> float:
    """Mean NLL of the held-out windows for a student keeping `kept` (its blocks `layers`, default the
    teacher's own), starting from the teacher's stream where the two first differ."""
    teacher_layers = decoder_layers(model)
    layers = layers if layers is not None else [teacher_layers[t] for t in kept]
    same = next((j for j, t in enumerate(kept) if t != j or layers[j] is not teacher_layers[t]), len(kept))
    # blocks 0..same-1 are the teacher's own: the student's stream is the teacher's up to boundary `same`
    out = run_layers(layers[same:], held.hidden[same], held.kwargs, device=device, batch=batch)
    return mean_nll(model, out, windows, device=device)


def repaired_layers(model: nn.Module, kept: list[int], fit: Walk, spec: RepairSpec, *,
                    on: Compute = Compute()) -> tuple[list[nn.Module], list[dict]]:
    """The student's blocks after the repair: copies of the teacher's blocks that the repair changes
    (from the first cut on), the teacher's own before it."""
    teacher_layers = decoder_layers(model)
    first = next((j for j, t in enumerate(kept) if t != j), len(kept))
    first_fit = max(0, first - 1)  # the block before the first cut carries its map
    layers = [teacher_layers[t] if j < first_fit else copy.deepcopy(teacher_layers[t]) for j, t in enumerate(kept)]
    rows = repair(layers, kept, fit, mlp_down(model), spec, on=Compute(on.device, on.batch))
    return layers, rows


def make_plan(model: nn.Module, keep: int, fit: Walk, held: Walk, held_windows: torch.Tensor, spec: RepairSpec, *,
              shortlist: int = 3, on: Compute = Compute()) -> Plan:
    """Score every candidate cut (module docstring) and choose the one with the smallest repaired drift.
    Once the shortlist is known, the boundaries of `fit` that neither its repairs nor `spec`'s repair of a
    shortlisted cut read are released from `fit` (Walk.keep_only: the walk is the largest thing a plan holds);
    a caller that reads more of the walk afterwards passes a view of its own (`fit.rows(...)`)."""
    progress, device, batch = on.progress or NullProgress(), on.device, on.batch
    L, n_fit = fit.n_layers, fit.hidden[0].shape[0]
    teacher_nll = mean_nll(model, held.hidden[-1], held_windows, device=device)
    cands = candidates(fit, keep, block_params(decoder_layers(model)))
    with progress.task("plan: drift of each cut", len(cands)) as bar:
        for c in cands:
            c.drift = drift_of(measured_nll(model, c.kept, held, held_windows, device=device, batch=batch), teacher_nll)
            bar.advance(1)
    ranked = sorted(cands, key=lambda c: c.drift)
    top = ranked[:shortlist] if spec.mode != "none" else []
    quick = replace(spec, follow=False)  # the map at each cut only: one block refit per candidate
    fit.keep_only(set().union(*(boundaries_read(c.kept, L, s) for c in top for s in (quick, spec))))
    if top:
        with progress.task("plan: drift after repair", len(top)) as bar:
            for c in top:
                layers, _ = repaired_layers(model, c.kept, fit, quick, on=on)
                nll = measured_nll(model, c.kept, held, held_windows, layers=layers, device=device, batch=batch)
                c.repaired_drift = drift_of(nll, teacher_nll)
                del layers
                bar.advance(1)
    choose(ranked, spec.mode != "none")  # ranked by unrepaired drift: only the shortlist has a repaired one
    return Plan(L, keep, math.exp(teacher_nll), cands, asdict(spec), n_fit, held.hidden[0].shape[0])
