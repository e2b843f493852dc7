"""The `prune` stage: choose the prunable weights, compute keep-masks with the chosen method, zero the rest.

Prunable weights: the linears of the decoder blocks (`arch.linears` under `arch.layers`), minus the
modules matching an `ignore` regex. Methods:
- magnitude, scope global: one |w| threshold over all of them (`threshold.py`, streamed, exact count);
- magnitude, scope layer: the same sparsity in every linear;
- wanda / sparsegpt: layer by layer over calibration windows (`layerwise.run_layerwise`), each decoder
  layer seeing the outputs of the already-pruned layers before it; with `true_sequential` (default)
  each group of linears inside a layer also sees inputs through the already-pruned groups before it,
  in one pass over the windows (`onepass.py`).
Any method with an N:M pattern prunes N of every M input columns.

Artifacts: `ctx.masks` (param name -> bool keep-mask) for a following distill stage, the same masks in
OUT/prune_masks.safetensors, OUT/prune_sparsity.png, and the per-layer table in the returned summary.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Container, NamedTuple

import torch
import torch.nn as nn

from geminicompress.compress.arch import Arch, arch_for, get_module
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.engine.layers import LayerJob
from geminicompress.engine.walk import run_layerwise
from geminicompress.threads import solver_threads
from geminicompress.compress.prune import report
from geminicompress.compress.prune.masks import Pattern, parse_pattern, pattern_mask, row_mask_count, tensor_mask
from geminicompress.compress.prune.plan import module_counts
from geminicompress.compress.prune.sparsegpt import sparsegpt_prune
from geminicompress.compress.prune.threshold import global_threshold, prune_mask
from geminicompress.compress.prune.wanda import InputNorms, wanda_mask, wanda_scores
from geminicompress.compress.targets import check_patterns_match, compile_patterns, decoder_linears, present_groups
from geminicompress.errors import InputError
from geminicompress.formats import sparse_bitmask
from geminicompress.formats.masks import MASKS_FILE, write_masks
from geminicompress.recipes.schema import PruneStage

HISTOGRAM_FILE = "prune_sparsity.png"


def prunable_weights(model: nn.Module, arch: Arch, ignore: list[str], check_ignore: bool) -> dict[str, nn.Linear]:
    """Param name ("model.layers.0.mlp.up_proj.weight") -> its linear, in model order, minus `ignore`.
    With `check_ignore` a pattern must match some module: prune's default ignore names a non-linear
    (embed_tokens), so every module counts, not only the linears."""
    if check_ignore:
        check_patterns_match(compile_patterns(ignore), [n for n, _ in model.named_modules()], "module of the model")
    out = {f"{name}.weight": get_module(model, name) for name in decoder_linears(model, arch, ignore)}
    if not out:
        raise InputError("the ignore patterns exclude every decoder linear layer: nothing left to prune")
    return out


def _check_pattern(targets: dict[str, nn.Linear], pattern: Pattern | None, block_size: int) -> None:
    if pattern is None:
        return
    n, m = pattern
    for name, lin in targets.items():
        if lin.in_features % m:
            raise InputError(f"{name} has {lin.in_features} input columns, not a multiple of M={m} in pattern {n}:{m}")
    if block_size % m:
        raise InputError(f"block_size {block_size} must be a multiple of M={m} so that N:M groups do not straddle blocks")


@torch.no_grad()
def magnitude_global(weights: list[torch.Tensor], sparsity: float) -> tuple[list[torch.Tensor], float]:
    """Keep-masks from one |w| threshold over all `weights` (exactly round(sparsity · total) pruned)."""
    k = round(sparsity * sum(w.numel() for w in weights))
    th = global_threshold(weights, k)
    return [~prune_mask(w, th.value, n) for w, n in zip(weights, th.ties)], th.value


@torch.no_grad()
def _magnitude(cfg: PruneStage, targets: dict[str, nn.Linear], pattern: Pattern | None,
               counts: dict[str, int] | None = None) -> tuple[dict, dict]:
    weights = [lin.weight for lin in targets.values()]
    if counts is not None:  # a per-linear allocation: exactly counts[name] lowest |w| of each
        keeps = [tensor_mask(w.detach().abs().float(), counts[n] / w.numel()) for n, w in zip(targets, weights)]
        extra = {}
    elif cfg.scope == "global":
        keeps, value = magnitude_global(weights, cfg.sparsity)
        extra = {"threshold": value if math.isfinite(value) else None}
    else:
        keeps = [pattern_mask(w.detach().abs().float(), cfg.sparsity, pattern, per_row=False) for w in weights]
        extra = {}
    return dict(zip(targets, keeps)), extra


def _wanda(W: torch.Tensor, norms: InputNorms, sparsity: float, count: int | None, pattern: Pattern | None,
           cfg: PruneStage, device: torch.device) -> torch.Tensor:
    """Wanda: zero the lowest |W|·‖X‖ of each row (exactly `count` of them for an allocation); no update."""
    if count is not None:
        keep = row_mask_count(wanda_scores(W, norms.norms()), count)
    else:
        keep = wanda_mask(W, norms.norms(), sparsity, pattern)
    W.masked_fill_(~keep, 0.0)
    return keep


def _sparsegpt(W: torch.Tensor, hessian: HessianAccumulator, sparsity: float, count: int | None,
               pattern: Pattern | None, cfg: PruneStage, device: torch.device) -> torch.Tensor:
    """SparseGPT: prune column by column and update the rest through the inverse Hessian."""
    with solver_threads(device):
        new, keep = sparsegpt_prune(W, hessian.H, sparsity, pattern, cfg.block_size, cfg.damp)
    W.copy_(new)
    return keep


class Criterion(NamedTuple):
    """A calibrated pruning criterion: the statistic of each linear's inputs it needs (built from the
    input width and the device, fed `add_batch(x)`), and the step that prunes one weight in place from it,
    returning the keep-mask: prune(W, statistic, sparsity, count or None, pattern, cfg, device)."""

    statistic: Callable[[int, torch.device], Any]
    prune: Callable[..., torch.Tensor]


# the calibrated methods, layer by layer (magnitude needs no calibration: `_magnitude`)
CALIBRATED: dict[str, Criterion] = {
    "wanda": Criterion(InputNorms, _wanda),
    "sparsegpt": Criterion(HessianAccumulator, _sparsegpt),
}


def _layer_fn(cfg: PruneStage, targets: Container[str], pattern: Pattern | None,
              alloc: dict[str, int] | None = None) -> Callable[[LayerJob], tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """The per-decoder-layer step of a calibrated criterion for `run_layerwise` (`targets`: the param names
    to prune; `alloc`: pruned weights per linear of an allocation, else cfg.sparsity everywhere)."""
    criterion = CALIBRATED[cfg.method]

    @torch.no_grad()
    def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        prefix = f"{job.arch.layers}.{job.index}"
        # linears of one `sequential` group read the same input: one statistic per group
        groups = present_groups(job.arch, lambda n: f"{prefix}.{n}.weight" in targets)
        stats: dict[str, Any] = {}
        for g in groups:
            stat = criterion.statistic(job.module(g[0]).in_features, job.device)
            stats.update({n: stat for n in g})
        kept: dict[str, torch.Tensor] = {}
        counts = [0, 0]  # zeros, total

        def solve(names: list[str]) -> None:
            for n in names:
                W = job.module(n).weight
                k = None if alloc is None else alloc[f"{prefix}.{n}.weight"]
                sparsity = cfg.sparsity if k is None else k / W.numel()
                keep = criterion.prune(W, stats[n], sparsity, k, pattern, cfg, job.device)
                kept[f"{n}.keep"] = keep.cpu()
                counts[0] += int((W == 0).sum())
                counts[1] += W.numel()

        if cfg.true_sequential:  # each group from inputs through the already-pruned groups, one pass
            job.one_pass(groups, lambda i, x: stats[groups[i][0]].add_batch(x), lambda i: solve(groups[i]))
        else:  # every statistic from the dense layer, then prune all
            job.forward({job.module(g[0]): (lambda x, y, acc=stats[g[0]]: acc.add_batch(x)) for g in groups})
            solve([n for g in groups for n in g])
        zeros, total = counts
        return {"sparsity": zeros / max(1, total)}, kept

    return process


def _calibrated(cfg: PruneStage, ctx: Any, arch: Arch, targets: dict[str, nn.Linear],
                pattern: Pattern | None, counts: dict[str, int] | None = None) -> tuple[dict, dict]:
    windows = ctx.calibration(cfg.data)
    _, kept = run_layerwise(ctx.model, windows, _layer_fn(cfg, targets, pattern, counts), device=ctx.device,
                            progress=ctx.progress, state_dir=ctx.state_dir, description=f"{cfg.method} layers")
    masks = {f"{arch.layers}.{k.removesuffix('.keep')}.weight": v.bool() for k, v in kept.items()}
    return {name: masks[name] for name in targets}, {"calibration_windows": int(windows.shape[0]),
                                                     "calibration_seq_len": int(windows.shape[1])}


def run(cfg: PruneStage, ctx: Any) -> dict[str, Any]:
    """Prune `ctx.model` in place; set `ctx.masks`; write the masks file and the histogram into OUT."""
    t0 = time.perf_counter()
    arch = arch_for(ctx.model)
    targets = prunable_weights(ctx.model, arch, cfg.ignore, check_ignore="ignore" in cfg.model_fields_set)
    pattern = parse_pattern(cfg.pattern)
    _check_pattern(targets, pattern, cfg.block_size)
    counts, planned = module_counts(cfg, ctx, arch, targets)  # owl / sensitivity allocations (plan.py)
    if cfg.method not in CALIBRATED:  # magnitude
        keeps, extra = _magnitude(cfg, targets, pattern, counts)
        with torch.no_grad():
            for name, lin in targets.items():
                lin.weight.masked_fill_(~keeps[name].to(lin.weight.device), 0.0)
    else:
        keeps, extra = _calibrated(cfg, ctx, arch, targets, pattern, counts)
    extra.update(planned)
    seconds = time.perf_counter() - t0

    ctx.masks = {name: keep.cpu() for name, keep in keeps.items()}
    write_masks(ctx.masks, ctx.out_dir)
    rows = report.layer_rows({name: lin.weight.detach() for name, lin in targets.items()}, arch.layers)
    achieved = report.overall(rows)
    requested = pattern[0] / pattern[1] if pattern else cfg.sparsity
    title = f"{cfg.method} {cfg.pattern or cfg.scope}: {achieved:.2%} of {sum(r['params'] for r in rows):,} weights"
    report.write_histogram(rows, ctx.out_dir / HISTOGRAM_FILE, title)
    high = [r for r in rows if r["sparsity"] > report.HIGH]
    if cfg.scope == "global":
        for r in high:
            ctx.progress.warn(f"{r['name']} lost {r['sparsity']:.1%} of its weights under the global threshold")
    ctx.progress.info(f"pruned {achieved:.2%} of {len(rows)} linear layers' weights ({cfg.method}, {cfg.pattern or cfg.scope})")
    if cfg.format == "compressed-tensors":
        structure = cfg.pattern or "unstructured"
        ctx.exporter = sparse_bitmask.exporter(ctx.recipe.output.dtype, ctx.masks, structure, achieved)
    return {
        "method": cfg.method, "scope": cfg.scope, "pattern": cfg.pattern,
        "requested_sparsity": requested, "achieved_sparsity": round(achieved, 6),
        "prunable_params": sum(r["params"] for r in rows), "pruned_params": sum(r["zeros"] for r in rows),
        "prune_seconds": round(seconds, 3), **extra,
        "layers_over_90pct": [r["name"] for r in high],
        "masks_file": MASKS_FILE, "histogram_file": HISTOGRAM_FILE, "layers": rows,
    }
