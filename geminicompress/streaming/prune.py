"""Streamed pruning: magnitude (global with an exact threshold from a streaming pass, per layer, N:M), and
the calibrated Wanda and SparseGPT through the in-memory stage's own per-layer step (`stage._layer_fn`).

Written dense, or as compressed-tensors sparse-bitmask (`--format compressed-tensors`) from each layer's
keep-masks. Allocations (owl, sensitivity) need a whole-model pass first and are not streamed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from geminicompress.compress.arch import get_module
from geminicompress.engine.compose import OnePassFn
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.models.lazy import LazyCheckpoint, LazyTensors
from geminicompress.progress import Progress
from geminicompress.streaming.output import SparseOutput
from geminicompress.streaming.stage import Done


class StreamedPrune:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype, state_dir: Path,
                 progress: Progress) -> None:
        from geminicompress.compress.prune.masks import parse_pattern
        from geminicompress.compress.prune.stage import CALIBRATED, _check_pattern, prunable_weights

        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        self.targets = list(prunable_weights(ckpt.model, ckpt.arch, cfg.ignore, "ignore" in cfg.model_fields_set))
        self.target_set = set(self.targets)
        self.pattern = parse_pattern(cfg.pattern)
        _check_pattern({n: get_module(ckpt.model, n.removesuffix(".weight")) for n in self.targets},
                       self.pattern, cfg.block_size)
        self.calibrated = cfg.method in CALIBRATED
        self.keeps_masks = cfg.format == "compressed-tensors"  # the sparse layout is written from them
        self.threshold: dict[str, Any] | None = None
        if not self.calibrated and cfg.scope == "global" and self.pattern is None:
            self.threshold = self._global_threshold(state_dir, progress)

    def _global_threshold(self, state_dir: Path, progress: Progress) -> dict[str, Any]:
        """The exact global |w| threshold, from a streaming pass over the checkpoint (cached for resuming)."""
        from geminicompress.compress.prune.threshold import global_threshold

        cache = state_dir / "threshold.json"
        if cache.is_file():
            return json.loads(cache.read_text())
        tensors = LazyTensors(self.ckpt, self.targets)
        k = round(self.cfg.sparsity * tensors.total)
        progress.info(f"global threshold: the {k:,}-th smallest |w| of {tensors.total:,}, streamed from disk")
        th = global_threshold(tensors, k, total=tensors.total)
        data = {"value": th.value, "ties": dict(zip(self.targets, th.ties)), "k": k}
        cache.write_text(json.dumps(data))
        return data

    def _linears(self, job: LayerJob) -> list[str]:
        """This layer's pruned linears, relative to the layer ("mlp.up_proj")."""
        prefix = f"{job.arch.layers}.{job.index}"
        return [n for n in job.arch.linears if f"{prefix}.{n}.weight" in self.target_set]

    def _weights(self, job: LayerJob) -> dict[str, torch.Tensor]:
        """This layer's pruned weights by param name."""
        prefix = f"{job.arch.layers}.{job.index}"
        return {f"{prefix}.{n}.weight": job.module(n).weight for n in self._linears(job)}

    def layer_fn(self) -> LayerFn:
        return self._calibrated_fn() if self.calibrated else self._magnitude_fn()

    def _magnitude_fn(self) -> LayerFn:
        from geminicompress.compress.prune import report
        from geminicompress.compress.prune.masks import pattern_mask
        from geminicompress.compress.prune.threshold import prune_mask

        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            weights = self._weights(job)
            kept = {}
            for linear, (name, W) in zip(self._linears(job), weights.items()):
                if self.threshold is not None:
                    pruned = prune_mask(W, self.threshold["value"], self.threshold["ties"][name])
                else:
                    pruned = ~pattern_mask(W.detach().abs().float(), self.cfg.sparsity, self.pattern, per_row=False)
                W.masked_fill_(pruned, 0.0)
                if self.keeps_masks:
                    kept[f"{linear}.keep"] = ~pruned  # named as the calibrated step names its masks
            rows = report.layer_rows(weights, job.arch.layers)
            return {"sparsity": report.overall(rows), "rows": rows}, kept

        return process

    def _calibrated_fn(self) -> LayerFn:
        """Wanda / SparseGPT: the in-memory stage's per-layer step; with true_sequential it only uses the
        layer through one `one_pass`, so it shares that pass with a following one-pass stage (compose.py).
        The rows count the zeros of the layer's weights after the step (or after the shared pass)."""
        from geminicompress.compress.prune import report
        from geminicompress.compress.prune.stage import _layer_fn

        step = _layer_fn(self.cfg, self.target_set, self.pattern)

        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            summary, kept = step(job)
            rows = report.layer_rows(self._weights(job), job.arch.layers)
            return {**summary, "rows": rows}, kept if self.keeps_masks else {}

        return OnePassFn(process) if self.cfg.true_sequential else process

    def output(self) -> SparseOutput | None:
        if self.cfg.format != "compressed-tensors":
            return None

        def masks(i: int, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            prefix = self.ckpt.layer_prefix(i)
            return {f"{prefix}.{k.removesuffix('.keep')}.weight": v for k, v in kept.items() if k.endswith(".keep")}

        return SparseOutput(self.ckpt, self.out_dtype, self.cfg.pattern or "unstructured", self.targets, masks)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        from geminicompress.compress.prune import report
        from geminicompress.compress.prune.stage import HISTOGRAM_FILE

        cfg = self.cfg
        rows = [r for s in layers for r in s.get("rows", [])]
        achieved = report.overall(rows)
        title = f"{cfg.method} {cfg.pattern or cfg.scope}: {achieved:.2%} of {sum(r['params'] for r in rows):,} weights"
        report.write_histogram(rows, done.out_dir / HISTOGRAM_FILE, title)
        high = [r for r in rows if r["sparsity"] > report.HIGH]
        done.progress.info(f"pruned {achieved:.2%} of {len(rows)} linear layers' weights ({cfg.method}, {cfg.pattern or cfg.scope})")
        extra: dict[str, Any] = {}
        if self.threshold is not None:
            value = self.threshold["value"]
            extra["threshold"] = value if math.isfinite(value) else None
        if self.calibrated:
            extra = {"calibration_windows": int(done.windows.shape[0]), "calibration_seq_len": int(done.windows.shape[1])}
        return {"method": cfg.method, "scope": cfg.scope, "pattern": cfg.pattern,
                "requested_sparsity": self.pattern[0] / self.pattern[1] if self.pattern else cfg.sparsity,
                "achieved_sparsity": round(achieved, 6), "prunable_params": sum(r["params"] for r in rows),
                "pruned_params": sum(r["zeros"] for r in rows), **extra,
                "layers_over_90pct": [r["name"] for r in high], "masks_file": None,
                "histogram_file": HISTOGRAM_FILE, "layers": rows, "streamed": True}
