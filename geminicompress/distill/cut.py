"""The cut student: an ordinary checkpoint of the teacher's architecture with fewer blocks (and optionally
narrower MLPs), its weights the teacher's, its down projections repaired in closed form (repair.py).

`cut_student` copies the kept blocks (student.derive_student: the config's per-layer lists follow them),
keeps the MLP channels with the largest activation importance (Minitron: survey.Walk.channels) when
`mlp_ratio` < 1, then runs the repair on the calibration walk. Nothing here is special to the student
after that: it saves with `save_pretrained`, loads with `AutoModelForCausalLM.from_pretrained`, and
serves or exports like the teacher.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for, decoder_layers
from geminicompress.distill.repair import RepairSpec, boundaries_read, repair
from geminicompress.distill.student import derive_student, n_params
from geminicompress.distill.survey import Compute, Walk, mlp_down
from geminicompress.host.progress import NullProgress, Progress


def important_channels(importance: torch.Tensor, kept: list[int], keep: int) -> dict[int, torch.Tensor]:
    """Teacher layer -> the `keep` MLP channels with the largest mean |activation| (sorted). importance: (L, I)."""
    return {t: importance[t].topk(keep).indices.sort().values for t in kept}


@dataclass(frozen=True)
class CutSpec:
    """How a student is cut from its teacher: which blocks (`derive`: measured by the plan, or even), the
    repair, how many calibration windows fit it (the rest measure drift), the plan's shortlist, MLP width."""

    derive: str = "measured"  # "measured" | "even"
    repair: RepairSpec = RepairSpec()
    fit_windows: int = 32
    shortlist: int = 3
    mlp_ratio: float = 1.0
    search: str = "candidates"  # "candidates" (plan.py's fixed ones) | "greedy" (also greedy.py's set)
    greedy_pool: int | None = 8


def cut_student(teacher: nn.Module, kept: list[int], fit: Walk, spec: RepairSpec, *, mlp_ratio: float = 1.0,
                on: Compute = Compute()) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The student keeping teacher blocks `kept` (and `mlp_ratio` of each MLP's channels), repaired on the
    calibration walk `fit`; returns it and the repair's rows (one per refit block)."""
    channels = None
    if mlp_ratio < 1.0:
        if fit.channels is None:
            raise ValueError("a narrower MLP needs the walk's channel importance")
        width = max(1, round(teacher.config.intermediate_size * mlp_ratio))
        channels = important_channels(fit.channels, kept, width)
    student, _ = derive_student(teacher, list(kept), mlp_ratio, channels=channels)
    rows = repair(list(decoder_layers(student)), kept, fit, mlp_down(teacher), spec, narrowed=mlp_ratio < 1.0, on=on)
    return student.to("cpu").eval(), rows


def planned_student(teacher: nn.Module, layers: int | float | list[int], windows: torch.Tensor, cut: CutSpec, *,
                    device: torch.device = torch.device("cpu"), progress: Progress | None = None
                    ) -> tuple[nn.Module, list[int], dict[str, Any]]:
    """plan -> cut -> repair on calibration windows (n, T): the first `cut.fit_windows` fit the repair, the rest
    measure drift. `layers`: a count or fraction (kept blocks chosen by `cut.derive`: measured or even) or a
    list. Returns the student, the teacher blocks it keeps and the plan table (plan.json)."""
    from geminicompress.distill.plan import Plan, make_plan
    from geminicompress.distill.student import keep_count, keep_layers
    from geminicompress.distill.survey import mean_nll, walk
    from geminicompress.eval.quality.perplexity import perplexity

    progress = progress or NullProgress()
    derive, spec, fit_windows, mlp_ratio = cut.derive, cut.repair, cut.fit_windows, cut.mlp_ratio
    n_layers = teacher.config.num_hidden_layers
    arch_for(teacher)  # an architecture whose blocks we cannot map is refused before the walk
    fit, held = walk(teacher, windows, device=device, progress=progress).split(fit_windows)
    held_ids = windows[fit_windows:]
    plan: Plan | None = None
    if isinstance(layers, list) or derive == "even" or keep_count(n_layers, layers) == n_layers:
        kept = keep_layers(n_layers, layers)
    else:
        greedy = cut.search == "greedy"  # reads the whole walk after the plan: the plan gets a view to release
        plan = make_plan(teacher, keep_count(n_layers, layers), fit.rows(0, fit_windows) if greedy or mlp_ratio < 1.0
                         else fit, held, held_ids, spec, shortlist=cut.shortlist, on=Compute(device, progress=progress))
        if greedy:
            from geminicompress.distill.greedy import add_greedy

            add_greedy(plan, teacher, fit, held, held_ids, spec, pool=cut.greedy_pool, on=Compute(device, progress=progress))
        kept = plan.chosen.kept
    fit.keep_only(boundaries_read(kept, n_layers, spec, narrowed=mlp_ratio < 1.0))  # all the repair reads
    held.keep_only({n_layers})
    student, rows = cut_student(teacher, kept, fit, spec, mlp_ratio=mlp_ratio, on=Compute(device, progress=progress))
    teacher_ppl = math.exp(mean_nll(teacher, held.hidden[-1], held_ids, device=device))
    student_ppl = perplexity(student, held_ids, device)
    table = plan.as_dict() if plan is not None else {"n_layers": n_layers, "keep": len(kept), "candidates": []}
    table.update({"derive": "list" if isinstance(layers, list) else derive, "kept": kept,
                  "dropped": [i for i in range(n_layers) if i not in kept], "mlp_ratio": mlp_ratio,
                  "repair": asdict(spec), "repair_rows": rows, "teacher_ppl": round(teacher_ppl, 4),
                  "student_ppl": round(student_ppl, 4), "student_drift": round(student_ppl / teacher_ppl - 1, 6),
                  "params_teacher": n_params(teacher), "params_student": n_params(student),
                  "decode": decode_times(teacher, student, windows[:1, :64])})
    table["predicted_drift"] = table["student_drift"]  # the held-out drift of this student, fully repaired
    return student, kept, table


def decode_times(teacher: nn.Module, student: nn.Module, prompt: torch.Tensor, gen_len: int = 17) -> dict[str, Any]:
    """Time per output token of teacher and student, timed as `eval` times it (`greedy_run`: the forward with the
    KV cache and an argmax, prefill excluded), median of 3 after a warm-up, in this process."""
    from geminicompress.eval.cost.latency import median_tpot

    t, s = (median_tpot(m, prompt, gen_len, next(m.parameters()).device, warmup=1) for m in (teacher, student))
    return {"teacher_ms_per_token": round(t * 1e3, 3), "student_ms_per_token": round(s * 1e3, 3),
            "student_vs_teacher": round(s / t, 4), "gen_len": gen_len, "prompt_len": prompt.shape[1],
            "note": "TPOT as eval times it, median of 3 after 1 warm-up, in the planning process; on a busy machine it is noise"}
