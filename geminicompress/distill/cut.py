"""The cut student: an ordinary checkpoint of the teacher's architecture with fewer blocks (and optionally
narrower MLPs), its weights the teacher's, its down projections repaired in closed form (repair.py).

`cut_student` copies the kept blocks (student.derive_student: the config's per-layer lists follow them),
keeps the MLP channels with the largest activation importance (Minitron: survey.Walk.channels) when
`mlp_ratio` < 1, then runs the repair on the calibration walk. Nothing here is special to the student
after that: it saves with `save_pretrained`, loads with `AutoModelForCausalLM.from_pretrained`, and
serves or exports like the teacher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.arch import decoder_layers
from geminicompress.distill.repair import RepairSpec, repair
from geminicompress.distill.student import derive_student
from geminicompress.distill.survey import Walk, mlp_down
from geminicompress.progress import Progress


def important_channels(importance: torch.Tensor, kept: list[int], keep: int) -> dict[int, torch.Tensor]:
    """Teacher layer -> the `keep` MLP channels with the largest mean |activation| (sorted). importance: (L, I)."""
    return {t: importance[t].topk(keep).indices.sort().values for t in kept}


def cut_student(teacher: nn.Module, kept: list[int], fit: Walk, spec: RepairSpec, *, mlp_ratio: float = 1.0,
                device: torch.device = torch.device("cpu"), batch: int = 4,
                progress: Progress | None = None) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The student keeping teacher blocks `kept` (and `mlp_ratio` of each MLP's channels), repaired on the
    calibration walk `fit`; returns it and the repair's rows (one per refit block)."""
    channels = None
    if mlp_ratio < 1.0:
        if fit.channels is None:
            raise ValueError("a narrower MLP needs the walk's channel importance")
        width = max(1, round(teacher.config.intermediate_size * mlp_ratio))
        channels = important_channels(fit.channels, kept, width)
    student, _ = derive_student(teacher, list(kept), mlp_ratio, channels=channels)
    rows = repair(list(decoder_layers(student)), kept, fit.hidden, fit.kwargs, mlp_down(teacher), spec,
                  narrowed=mlp_ratio < 1.0, device=device, batch=batch, progress=progress)
    return student.to("cpu").eval(), rows
