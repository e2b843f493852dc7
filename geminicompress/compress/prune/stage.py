"""The `prune` stage: choose the prunable weights, compute keep-masks with the chosen method, zero the rest.

Prunable weights: the linears of the decoder blocks (`arch.linears` under `arch.layers`), minus the
modules matching an `ignore` regex. Methods:
- magnitude, scope global: one |w| threshold over all of them (`threshold.py`, streamed, exact count);
- magnitude, scope layer: the same sparsity in every linear;
- wanda / sparsegpt: layer by layer over calibration windows (the engine's walk), each decoder layer
  seeing the outputs of the already-pruned layers before it; with `true_sequential` (default) each group
  of linears inside a layer also sees inputs through the already-pruned groups before it, in one pass
  over the windows (engine/onepass.py).
Any method with an N:M pattern prunes N of every M input columns.

Artifacts: `ctx.masks` (param name -> bool keep-mask) for a following distill stage and the same masks in
OUT/prune_masks.safetensors (a model in memory: a streamed run holds no masks), OUT/prune_sparsity.png,
and the per-layer table in the returned summary. Written dense, or as compressed-tensors sparse-bitmask.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn

from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.prune import report
from geminicompress.compress.prune.config import PruneStage
from geminicompress.compress.prune.masks import Pattern, parse_pattern, pattern_mask, row_mask_count, tensor_mask
from geminicompress.compress.prune.plan import module_counts
from geminicompress.compress.prune.sparsegpt import sparsegpt_prune
from geminicompress.compress.prune.threshold import global_threshold, prune_mask
from geminicompress.compress.prune.wanda import InputNorms, wanda_mask, wanda_scores
from geminicompress.compress.targets import check_patterns_match, compile_patterns, decoder_linears, present_groups
from geminicompress.core.arch import Arch, arch_for, get_module
from geminicompress.core.config import ignore_to_check
from geminicompress.engine.compose import OnePassFn
from geminicompress.engine.contract import Done, LayerStage, StageContext
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.core.errors import InputError
from geminicompress.formats.masks import MASKS_FILE, write_masks
from geminicompress.formats.sparse_bitmask import SparseWriter
from geminicompress.host.threads import solver_threads

HISTOGRAM_FILE = "prune_sparsity.png"


def prunable_weights(model: nn.Module, arch: Arch, ignore: list[str], check_ignore: list[str]) -> dict[str, nn.Linear]:
    """Param name ("model.layers.0.mlp.up_proj.weight") -> its linear, in model order, minus `ignore`.
    Each pattern in `check_ignore` must match some module: prune's default ignore names a non-linear
    (embed_tokens), so every module counts, not only the linears."""
    if check_ignore:
        check_patterns_match(compile_patterns(check_ignore), [n for n, _ in model.named_modules()], "module of the model")
    out = {f"{name}.weight": get_module(model, name) for name in decoder_linears(model, arch, ignore)}
    if not out:
        raise InputError("the ignore patterns exclude every decoder linear layer: nothing left to prune")
    return out


def check_pattern(targets: dict[str, nn.Linear], pattern: Pattern | None, block_size: int) -> None:
    if pattern is None:
        return
    n, m = pattern
    for name, lin in targets.items():
        if lin.in_features % m:
            raise InputError(f"{name} has {lin.in_features} input columns, not a multiple of M={m} in pattern {n}:{m}")
    if block_size % m:
        raise InputError(f"block_size {block_size} must be a multiple of M={m} so that N:M groups do not straddle blocks")


def _wanda(W: torch.Tensor, norms: InputNorms, sparsity: float, count: int | None, pattern: Pattern | None,
           cfg: PruneStage, device: torch.device) -> torch.Tensor:
    """Wanda: zero the lowest |W|·‖X‖ of each row (exactly `count` of them for an allocation); no update."""
    keep = (wanda_mask(W, norms.norms(), sparsity, pattern) if count is None else
        row_mask_count(wanda_scores(W, norms.norms()), count))
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


# the calibrated methods, layer by layer (magnitude needs no calibration: `Prune._magnitude_fn`)
CALIBRATED: dict[str, Criterion] = {
    "wanda": Criterion(InputNorms, _wanda),
    "sparsegpt": Criterion(HessianAccumulator, _sparsegpt),
}


class Prune(LayerStage):
    """A prune stage as the engine runs it. Opening (before any work): the prunable weights, the pattern
    check, and the whole-model decisions as pre-passes that produce per-layer parameters: the exact global
    magnitude threshold (one streaming pass over the weights: threshold.py; cached in the run's state for a
    resumed run), or the per-linear counts of an allocation (plan.py: owl, sensitivity)."""

    @staticmethod
    def cannot_stream(cfg: PruneStage, first: bool) -> str | None:
        """Why this stage cannot run one layer at a time from disk (None: it can)."""
        if cfg.allocation == "sensitivity" and cfg.sensitivity is None:
            return ("prune --allocation sensitivity measures its sensitivity table with the model in memory; give "
                    "a table (--sensitivity sensitivity.json, from `geminicompress sensitivity`) or run it with --no-stream")
        if (cfg.method == "magnitude" and cfg.scope == "global" and cfg.pattern is None and cfg.allocation is None
                and not first):
            return "global magnitude pruning streams only as the first stage"
        return None

    def __init__(self, cfg: PruneStage, ctx: StageContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.squares = 2 if cfg.method == "sparsegpt" else 0  # float32 (in)² buffers at its peak (estimate.py)
        self.one_pass_memory = cfg.method in CALIBRATED and cfg.true_sequential
        self.rounds_floats = cfg.method == "sparsegpt"  # updates the weights it keeps (written rounded, if lower)
        self.arch = arch_for(ctx.model)
        linears = prunable_weights(ctx.model, self.arch, cfg.ignore, check_ignore=ignore_to_check(cfg))
        self.targets = list(linears)
        self.pattern = parse_pattern(cfg.pattern)
        check_pattern(linears, self.pattern, cfg.block_size)
        t0 = time.perf_counter()
        self.counts, self.planned = module_counts(cfg, ctx, self.arch, linears)  # owl / sensitivity (plan.py)
        self.calibrated = cfg.method in CALIBRATED
        self.threshold: dict[str, Any] | None = None
        if not self.calibrated and self.counts is None and cfg.scope == "global" and self.pattern is None:
            self.threshold = self._global_threshold()
        self.plan_seconds = time.perf_counter() - t0

    def _global_threshold(self) -> dict[str, Any]:
        """The exact global |w| threshold over every prunable weight, read one tensor at a time from the
        source (cached in the state folder for a resumed run)."""
        cache = self.ctx.state_dir / "threshold.json"
        if cache.is_file():
            return json.loads(cache.read_text())
        tensors = self.ctx.layers.tensors(self.targets)  # the model's own, or read from disk one at a time
        total = sum(self.ctx.model.get_parameter(n).numel() for n in self.targets)
        k = round(self.cfg.sparsity * total)
        if self.ctx.streamed:
            self.ctx.progress.info(f"global threshold: the {k:,}-th smallest |w| of {total:,}, streamed from disk")
        th = global_threshold(tensors, k, total=total)
        data = {"value": th.value, "ties": dict(zip(self.targets, th.ties)), "k": k}
        cache.write_text(json.dumps(data))
        return data

    def _weights(self, job: LayerJob) -> dict[str, torch.Tensor]:
        """This layer's pruned weights by param name, in the architecture's order."""
        prefix = f"{job.arch.layers}.{job.index}"
        names = set(self.targets)
        return {f"{prefix}.{n}.weight": job.module(n).weight for n in job.arch.linears if f"{prefix}.{n}.weight" in names}

    def layer_fn(self) -> LayerFn:
        return self._calibrated_fn() if self.calibrated else self._magnitude_fn()

    def _magnitude_fn(self) -> LayerFn:
        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            weights = self._weights(job)
            kept = {}
            for name, W in weights.items():
                if self.counts is not None:  # an allocation: exactly counts[name] lowest |w|
                    pruned = ~tensor_mask(W.detach().abs().float(), self.counts[name] / W.numel())
                elif self.threshold is not None:
                    pruned = prune_mask(W, self.threshold["value"], self.threshold["ties"][name])
                else:
                    pruned = ~pattern_mask(W.detach().abs().float(), self.cfg.sparsity, self.pattern, per_row=False)
                W.masked_fill_(pruned, 0.0)
                keep = pruned.logical_not_()  # in place: no second mask
                kept[f"{name.removeprefix(job.arch.layers + f'.{job.index}.').removesuffix('.weight')}.keep"] = keep
            rows = report.layer_rows(weights, job.arch.layers)
            return {"sparsity": report.overall(rows), "rows": rows}, kept

        return process

    def _calibrated_fn(self) -> LayerFn:
        """Wanda / SparseGPT (`CALIBRATED`): one statistic per group of linears reading one input, then each
        linear pruned from it (exactly `counts[name]` weights for an allocation, else cfg.sparsity everywhere).
        With true_sequential it only uses the layer through one `one_pass`, so it shares that pass with a
        following one-pass stage in a streamed recipe (compose.py). The rows count the zeros of the layer's
        weights after the step (or after the shared pass)."""
        cfg, criterion, targets, alloc = self.cfg, CALIBRATED[self.cfg.method], set(self.targets), self.counts

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
                    keep = criterion.prune(W, stats[n], sparsity, k, self.pattern, cfg, job.device)
                    kept[f"{n}.keep"] = keep.cpu()
                    counts[0] += int((W == 0).sum())
                    counts[1] += W.numel()

            if cfg.true_sequential:  # each group from inputs through the already-pruned groups, one pass
                job.one_pass(groups, lambda i, x: stats[groups[i][0]].add_batch(x), lambda i: solve(groups[i]))
            else:  # every statistic from the dense layer, then prune all
                job.forward({job.module(g[0]): (lambda x, y, acc=stats[g[0]]: acc.add_batch(x)) for g in groups})
                solve([n for g in groups for n in g])
            zeros, total = counts
            rows = report.layer_rows(self._weights(job), job.arch.layers)
            return {"sparsity": zeros / max(1, total), "rows": rows}, kept

        return OnePassFn(process) if cfg.true_sequential else process

    def masks(self, i: int, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer i's keep-masks by param name."""
        prefix = self.ctx.layer_prefix(i)
        return {f"{prefix}.{k.removesuffix('.keep')}.weight": v for k, v in kept.items() if k.endswith(".keep")}

    def writer(self) -> Any:
        if self.cfg.format != "compressed-tensors":
            return None
        return SparseWriter(self.ctx.model, self.ctx.out_dtype, self.cfg.pattern or "unstructured", self.targets,
                            self.masks)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        cfg = self.cfg
        rows = [r for s in layers for r in s.get("rows", [])]
        achieved = report.overall(rows)
        title = f"{cfg.method} {cfg.pattern or cfg.scope}: {achieved:.2%} of {sum(r['params'] for r in rows):,} weights"
        report.write_histogram(rows, done.out_dir / HISTOGRAM_FILE, title)
        high = [r for r in rows if r["sparsity"] > report.HIGH]
        if cfg.scope == "global":
            for r in high:
                done.progress.warn(f"{r['name']} lost {r['sparsity']:.1%} of its weights under the global threshold")
        done.progress.info(f"pruned {achieved:.2%} of {len(rows)} linear layers' weights "
                           f"({cfg.method}, {cfg.pattern or cfg.scope})")
        extra: dict[str, Any] = dict(self.planned)
        if self.threshold is not None:
            value = self.threshold["value"]
            extra["threshold"] = value if math.isfinite(value) else None
        if self.calibrated:
            extra.update(calibration_windows=int(done.windows.shape[0]), calibration_seq_len=int(done.windows.shape[1]))
        keeps = {f"{self.arch.layers}.{k.removesuffix('.keep')}.weight": v
                 for k, v in done.kept.items() if k.endswith(".keep")}
        if keeps:  # held for a following distill stage (a model in memory), and beside the weights
            self.ctx.masks = {name: keeps[name].bool().cpu() for name in self.targets}
            write_masks(self.ctx.masks, done.out_dir)
        return {"method": cfg.method, "scope": cfg.scope, "pattern": cfg.pattern,
                "requested_sparsity": self.pattern[0] / self.pattern[1] if self.pattern else cfg.sparsity,
                "achieved_sparsity": round(achieved, 6), "prunable_params": sum(r["params"] for r in rows),
                "pruned_params": sum(r["zeros"] for r in rows), "plan_seconds": round(self.plan_seconds, 3),
                **extra, "layers_over_90pct": [r["name"] for r in high], "masks_file": MASKS_FILE if keeps else None,
                "histogram_file": HISTOGRAM_FILE, "layers": rows}
