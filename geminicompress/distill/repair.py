"""Closed-form repair of a cut student, before any training (ReplaceMe, Shopkhoev et al. 2025;
LLM-Streamline, Chen et al. 2024).

When blocks i..i+n-1 are dropped, block i-1 (the last kept one before them) writes its MLP output y into
the residual stream: its output is mid + y, where mid is the stream after its attention. The teacher's
stream after the dropped span is h_{i+n}. Two repairs, both merged into block i-1's down projection
W (d, I) (y = a W^T for its input activations a (N, I)), so the student stays an ordinary checkpoint of
the teacher's architecture with fewer layers:

- `linear` (ReplaceMe): a map T (d, d) with  y T ~ h_{i+n} - mid,  least squares with a ridge term
      T = (Y^T Y + lam I)^-1 Y^T R,   R = h_{i+n} - mid;   merged: W' = T^T W (bias b' = b T)
  or, with the cosine objective, T minimizing mean(1 - cos(mid + y T, h_{i+n})), started from the
  least-squares T and refined by Adam (ReplaceMe's cosine variant; no closed form).
- `down_proj`: W itself refit on a:  W' = argmin ||a W'^T - R||^2 + lam ||W' - W||^2  (ridge towards the
  teacher's weights), which contains every `linear` map (T^T W is one such W') and has I x d parameters.

The same least squares refits the down projection of a narrower MLP on its kept channels (target: the
teacher block's output), and, with `follow`, the kept blocks after a cut, whose inputs now differ from
the teacher's, so that each student block's output tracks the teacher's stream at the same boundary
(the layer-wise reconstruction of SparseGPT/GPTQ, applied to one linear per block).

lam is `ridge` times the mean diagonal of the Gram matrix (scale-free), as GPTQ's damping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.distill.survey import Compute, Walk
from geminicompress.engine.layers import layer_output
from geminicompress.host.progress import NullProgress

RepairMode = Literal["down_proj", "linear", "none"]
Objective = Literal["mse", "cosine"]
Weighting = Literal["uniform", "skip_first", "inverse_norm"]


class LeastSquares:
    """Accumulates X^T X and X^T Y batch by batch (X (N, k), Y (N, m)); `solve` gives W (k, m) minimizing
    ||X W - Y||^2 + lam ||W - prior||^2 with lam = ridge * mean(diag(X^T X))."""

    def __init__(self, k: int, m: int) -> None:
        self.xtx = torch.zeros(k, k, dtype=torch.float64)
        self.xty = torch.zeros(k, m, dtype=torch.float64)
        self.rows = 0

    def add_batch(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Rows of x (..., k) and y (..., m); `weight` (...) scales each row's squared error (X^T D X, X^T D Y)."""
        x, y = x.reshape(-1, x.shape[-1]).float().cpu(), y.reshape(-1, y.shape[-1]).float().cpu()
        xw = x if weight is None else x * weight.reshape(-1, 1).float().cpu()
        self.xtx += (xw.T @ x).double()  # a batch's products in float32, the running sums in float64
        self.xty += (xw.T @ y).double()
        self.rows += x.shape[0]

    def solve(self, ridge: float, prior: torch.Tensor | None = None) -> torch.Tensor:
        lam = ridge * float(self.xtx.diagonal().mean().clamp_min(1e-12))
        a = self.xtx + lam * torch.eye(self.xtx.shape[0], dtype=torch.float64)
        b = self.xty + (lam * prior.double().cpu() if prior is not None else 0.0)
        return torch.linalg.solve(a, b).float()  # (k, m)


def merge_map(weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold a map T (d, d) applied after y = a W^T + b into the linear: (T^T W, b T). weight (d, I)."""
    new_w = (t.T.double() @ weight.double()).to(weight.dtype)
    return new_w, (bias.double() @ t.double()).to(bias.dtype) if bias is not None else None


def cosine_map(y: torch.Tensor, mid: torch.Tensor, target: torch.Tensor, start: torch.Tensor, *, steps: int = 100,
               lr: float = 1e-4, chunk: int = 4096) -> torch.Tensor:
    """T (d, d) minimizing mean(1 - cos(mid + y T, target)) over tokens, from `start`, by full-batch Adam.
    y, mid, target: (N, d)."""
    t = start.clone().float().requires_grad_(True)
    opt = torch.optim.Adam([t], lr=lr)
    n = y.shape[0]
    for _ in range(steps):
        opt.zero_grad()
        for s in range(0, n, chunk):
            pred = mid[s:s + chunk] + y[s:s + chunk] @ t
            loss = (1 - F.cosine_similarity(pred, target[s:s + chunk], dim=-1)).sum() / n
            loss.backward()
        opt.step()
    return t.detach()


@dataclass(frozen=True)
class RepairSpec:
    mode: RepairMode = "down_proj"
    objective: Objective = "mse"
    ridge: float = 0.1  # measured on the demo: docs/distill.md (1e-3 -> 0.1: 55.16 -> 54.27)
    follow: bool = False  # also refit the kept blocks after a cut (measured worse on the demo: docs/distill.md)
    cosine_steps: int = 100
    weighting: Weighting = "uniform"


def token_weights(target: torch.Tensor, weighting: Weighting) -> torch.Tensor | None:
    """Each token's weight in the repair's squared error; target (n, T, d) -> (n, T), None for uniform.
    - skip_first: position 0 (the attention sink, whose massive activations can dominate X^T X) left out;
    - inverse_norm: 1 / ||target||^2 per token, normalized to mean 1: the relative error per token, what the
      next block's RMSNorm sees (a closed-form stand-in for the cosine objective)."""
    if weighting == "uniform":
        return None
    if weighting == "skip_first":
        w = torch.ones(target.shape[:-1])
        w[:, 0] = 0.0
        return w
    w = 1.0 / target.double().pow(2).sum(-1).clamp_min(1e-12)  # (n, T)
    return (w / w.mean()).float()


@torch.no_grad()
def _capture(layer: nn.Module, down: str, h: torch.Tensor, kwargs: dict[str, Any], device: torch.device,
             batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, y, mid) of the layer on h (n, T, d): the down projection's input (n, T, I), its output (n, T, d)
    and the stream before it (layer output - y)."""
    seen: dict[str, torch.Tensor] = {}
    a_parts, y_parts, mid_parts = [], [], []
    handle = layer.get_submodule(down).register_forward_hook(
        lambda m, args, out: seen.update(a=args[0].detach(), y=out.detach()))
    try:
        for b in range(0, h.shape[0], batch):
            out = layer_output(layer, h[b:b + batch].to(device), kwargs)
            a_parts.append(seen["a"].cpu())
            y_parts.append(seen["y"].cpu())
            mid_parts.append((out - seen["y"]).cpu())
    finally:
        handle.remove()
    return torch.cat(a_parts), torch.cat(y_parts), torch.cat(mid_parts)


def refit_block(layer: nn.Module, down: str, h_in: torch.Tensor, target: torch.Tensor, kwargs: dict[str, Any],
                spec: RepairSpec, *, device: torch.device, batch: int = 4) -> tuple[torch.Tensor, dict[str, float]]:
    """Refit the layer's down projection so that its output on h_in (n, T, d) approaches target (n, T, d);
    writes the new weight (and bias) into the layer and returns its output on h_in and the relative errors
    before/after."""
    lin = layer.get_submodule(down)
    a, y, mid = _capture(layer, down, h_in, kwargs, device, batch)  # (n, T, I), (n, T, d), (n, T, d)
    resid = target - mid
    wt = token_weights(target, spec.weighting)  # (n, T) or None
    bias = lin.bias.detach().cpu() if lin.bias is not None else None
    if spec.mode == "linear":
        ls = LeastSquares(y.shape[-1], y.shape[-1])
        for s in range(0, y.shape[0], batch):
            ls.add_batch(y[s:s + batch], resid[s:s + batch], None if wt is None else wt[s:s + batch])
        t = ls.solve(spec.ridge)  # (d, d)
        if spec.objective == "cosine":
            t = cosine_map(y.flatten(0, 1), mid.flatten(0, 1), target.flatten(0, 1), t, steps=spec.cosine_steps)
        w, b = merge_map(lin.weight.detach().cpu(), bias, t)
    else:
        x = a if bias is None else torch.cat([a, torch.ones(*a.shape[:-1], 1)], dim=-1)
        prior = lin.weight.detach().cpu().T if bias is None else torch.cat([lin.weight.detach().cpu().T, bias[None]])
        ls = LeastSquares(x.shape[-1], resid.shape[-1])
        for s in range(0, x.shape[0], batch):
            ls.add_batch(x[s:s + batch], resid[s:s + batch], None if wt is None else wt[s:s + batch])
        sol = ls.solve(spec.ridge, prior)  # (I [+1], d)
        w, b = sol[: a.shape[-1]].T.contiguous(), (sol[-1] if bias is not None else None)
    lin.weight.data.copy_(w.to(lin.weight.dtype))
    if b is not None:
        lin.bias.data.copy_(b.to(lin.bias.dtype))
    new_y = a @ w.T + (b if b is not None else 0.0)
    out = mid + new_y
    err = {"error_before": _rel(mid + y, target), "error_after": _rel(out, target)}
    return out, err


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).double().norm() / ref.double().norm().clamp_min(1e-30))


@dataclass(frozen=True)
class Step:
    """What repair() does with student block j (the teacher's block t), whose output the student's next block
    reads where the teacher's stream is at boundary `nxt`: "teacher" (the student's stream is still the
    teacher's: nothing to run), "refit" (refit towards hidden[nxt]) or "replay" (run it on the moved stream)."""

    j: int
    t: int
    nxt: int
    action: Literal["teacher", "refit", "replay"]


def repair_steps(kept: Sequence[int], n_layers: int, spec: RepairSpec, narrowed: bool = False) -> list[Step]:
    """repair()'s steps for a student keeping the teacher blocks `kept` (module docstring): a refit for every
    block followed by a dropped run, for every block when `narrowed`, and with spec.follow for every block
    whose input differs from the teacher's; nothing after the last refit that matters."""
    if spec.mode == "none" and not narrowed:
        return []
    moved = kept[0] != 0  # the student's stream differs from the teacher's at its own boundary
    nexts = [*kept[1:], n_layers]
    # without follow or a narrowed MLP only the blocks before a cut are refit: the walk stops after the last
    last = len(kept) - 1 if narrowed or spec.follow else max(
        (j for j, t in enumerate(kept) if nexts[j] != t + 1), default=-1)
    steps = []
    for j, t in enumerate(kept[: last + 1]):
        cut_after = nexts[j] != t + 1
        if narrowed or (spec.mode != "none" and (cut_after or (spec.follow and moved))):
            steps.append(Step(j, t, nexts[j], "refit"))
            moved = True
        elif moved:
            steps.append(Step(j, t, nexts[j], "replay"))
        else:
            steps.append(Step(j, t, nexts[j], "teacher"))
            moved = cut_after
    return steps


def boundaries_read(kept: Sequence[int], n_layers: int, spec: RepairSpec, narrowed: bool = False) -> set[int]:
    """The teacher boundaries repair() reads for this cut: where the student's stream leaves the teacher's
    (the first block it runs reads it) and every refit's target."""
    steps = repair_steps(kept, n_layers, spec, narrowed)
    ran = [k for k, step in enumerate(steps) if step.action != "teacher"]
    if not ran:
        return set()
    src = steps[ran[0] - 1].t + 1 if ran[0] else kept[0]
    return {src} | {step.nxt for step in steps if step.action == "refit"}


@torch.no_grad()
def repair(layers: Sequence[nn.Module], kept: Sequence[int], fit: Walk, down: str, spec: RepairSpec, *,
           narrowed: bool = False, on: Compute = Compute()) -> list[dict[str, Any]]:
    """Repair the student's blocks `layers` in place (student block j is the teacher's block kept[j]) on the
    teacher's boundaries fit.hidden (L + 1 of (n, T, d); only `boundaries_read` are read). Block j's target is
    the teacher's stream where the student's next block reads it: hidden[kept[j + 1]] (the last block:
    hidden[L]); the steps: `repair_steps`. Returns one row per refit block."""
    progress, device, batch = on.progress or NullProgress(), on.device, on.batch
    hidden, kwargs = fit.hidden, fit.kwargs
    steps = repair_steps(kept, len(hidden) - 1, spec, narrowed)
    rows: list[dict[str, Any]] = []
    if not steps:
        return rows
    src, h = kept[0], None  # the student's stream: the teacher's boundary src until a block of its own runs
    with progress.task("repair", len(layers)) as bar:
        for layer, step in zip(layers, steps):
            layer.to(device)
            bar.advance(1)
            if step.action == "teacher":
                src = step.t + 1
                continue
            h = hidden[src] if h is None else h
            if step.action == "replay":
                h = torch.cat([layer_output(layer, h[b:b + batch].to(device), kwargs).cpu()
                               for b in range(0, h.shape[0], batch)])
                continue
            mode = spec if spec.mode != "none" else replace(spec, mode="down_proj", objective="mse")
            if step.nxt == step.t + 1 and mode.mode == "linear":
                mode = replace(spec, mode="down_proj", objective="mse")  # after a cut: the block's own refit
            h, err = refit_block(layer, down, h, hidden[step.nxt], kwargs, mode, device=device, batch=batch)
            rows.append({"student_layer": step.j, "teacher_layer": step.t, "target_boundary": step.nxt,
                         "mode": mode.mode, **{k: round(v, 6) for k, v in err.items()}})
        for layer in layers[len(steps):]:
            layer.to(device)
            bar.advance(1)
    return rows
