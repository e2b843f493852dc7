"""Layer-wise reconstruction of a pruned student from its dense teacher, before training.

The student is a pruned copy of the teacher: the same decoder layers and shapes, with zeros fixed by
masks. Layer by layer (the engine's walk), every masked linear is refit in closed form
(`compress/prune/refit.py`) so that on the inputs the already-refit student feeds it, it reproduces the
teacher's dense linear as closely as its mask allows:

    W' = argmin ‖(W' − W_teacher) X_student‖²,  W' = 0 off the mask.

Groups of linears go in true-sequential order in one pass over the windows (`onepass.py`), as SparseGPT
does; each layer's inputs come through the student's already-refit layers. This is layer-wise
distillation with an exact solution, the mask untouched; the logit-level training that follows starts
far closer to the teacher (docs/benchmarks.md, distillation).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.prune.refit import refit_masked
from geminicompress.compress.targets import present_groups
from geminicompress.core.arch import arch_for, get_module
from geminicompress.engine.layers import LayerJob
from geminicompress.engine.walk import WalkOptions, run_layerwise
from geminicompress.core.errors import InputError
from geminicompress.host.progress import Progress


def check_same_shape(student: nn.Module, teacher: nn.Module) -> None:
    """Reconstruction pairs each student linear with the teacher's: both must have the same layers and shapes."""
    arch_s, arch_t = arch_for(student), arch_for(teacher)
    n_s = len(get_module(student, arch_s.layers))
    n_t = len(get_module(teacher, arch_t.layers))
    if arch_s != arch_t or n_s != n_t:
        raise InputError(f"reconstruct needs a student with the teacher's layers (a pruned copy of it); this student "
                         f"has {n_s} decoder layers and the teacher {n_t}: drop reconstruct, or prune the teacher itself")
    t_params = dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if name in t_params and t_params[name].shape != p.shape:
            raise InputError(f"reconstruct needs a student shaped like the teacher: {name} is {tuple(p.shape)} in the "
                             f"student and {tuple(t_params[name].shape)} in the teacher")


def reconstruct(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, masks: dict[str, torch.Tensor], *,
                device: torch.device, damp: float = 0.01, progress: Progress | None = None,
                state_dir: Path | None = None) -> dict[str, Any]:
    """Refit every masked decoder linear of `student` (in place) to the teacher's; returns a summary.

    windows: (n, T) calibration token ids; masks: param name -> keep-mask (True = kept), as the prune stage writes.
    """
    check_same_shape(student, teacher)
    arch = arch_for(student)
    teacher_layers = get_module(teacher, arch.layers)
    if not any(name.startswith(f"{arch.layers}.") for name in masks):
        raise InputError("reconstruct needs a pruned student (its masks); this one has no pruned decoder linear")
    t0 = time.perf_counter()

    @torch.no_grad()
    def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        prefix = f"{arch.layers}.{job.index}"
        groups = present_groups(arch, lambda n: f"{prefix}.{n}.weight" in masks)
        stats = [HessianAccumulator(job.module(g[0]).in_features, job.device) for g in groups]
        errors = [0.0, 0.0, 0.0]  # before, after, reference: Σ tr(ΔW H ΔWᵀ) and Σ tr(W H Wᵀ)

        def solve(i: int) -> None:
            H = stats[i].H  # (in, in)
            for name in groups[i]:
                target = get_module(teacher_layers[job.index], name).weight.detach().to(job.device, torch.float32)
                keep = masks[f"{prefix}.{name}.weight"].to(job.device)
                before = job.weight(name).float()
                new = refit_masked(target, H, keep, damp)
                errors[0] += _output_error(before - target, H)
                errors[1] += _output_error(new - target, H)
                errors[2] += _output_error(target, H)
                job.set_weight(name, new.to(before.dtype))

        job.one_pass(groups, lambda i, x: stats[i].add_batch(x), solve)
        ref = max(errors[2], 1e-30)
        return {"error_before": errors[0] / ref, "error_after": errors[1] / ref}, {}

    summaries = run_layerwise(student, windows, process, WalkOptions(device=device, progress=progress,
                                                                     state_dir=state_dir,
                                                                     description="reconstruct layers")).summaries
    return {"windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]), "damp": damp,
            "seconds": round(time.perf_counter() - t0, 3),
            "layers": [{k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()} for s in summaries]}


def _output_error(delta: torch.Tensor, H: torch.Tensor) -> float:
    """tr(Δ H Δᵀ): the squared output error of a weight change Δ (out, in) on the inputs behind H (in, in)."""
    return float(((delta @ H) * delta).sum())
