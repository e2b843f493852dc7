"""Streamed magnitude pruning (global with an exact threshold from a streaming pass, per layer, N:M)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from geminicompress.compress.arch import get_module
from geminicompress.compress.layerwise import LayerFn, LayerJob
from geminicompress.models.lazy import LazyCheckpoint, LazyTensors
from geminicompress.progress import Progress


class StreamedPrune:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, state_dir: Path, progress: Progress) -> None:
        from geminicompress.compress.prune.masks import parse_pattern
        from geminicompress.compress.prune.stage import _check_pattern, prunable_weights

        self.cfg, self.ckpt = cfg, ckpt
        self.targets = list(prunable_weights(ckpt.model, ckpt.arch, cfg.ignore, "ignore" in cfg.model_fields_set))
        self.pattern = parse_pattern(cfg.pattern)
        _check_pattern({n: get_module(ckpt.model, n.removesuffix(".weight")) for n in self.targets},
                       self.pattern, cfg.block_size)
        self.threshold: dict[str, Any] | None = None
        if cfg.scope == "global" and self.pattern is None:
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

    def layer_fn(self) -> LayerFn:
        from geminicompress.compress.prune import report
        from geminicompress.compress.prune.masks import pattern_mask
        from geminicompress.compress.prune.threshold import prune_mask

        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            prefix = f"{job.arch.layers}.{job.index}"
            weights = {}
            for n in job.arch.linears:
                name = f"{prefix}.{n}.weight"
                if name not in self.targets:
                    continue
                W = job.module(n).weight
                if self.threshold is not None:
                    pruned = prune_mask(W, self.threshold["value"], self.threshold["ties"][name])
                else:
                    pruned = ~pattern_mask(W.detach().abs().float(), self.cfg.sparsity, self.pattern, per_row=False)
                W.masked_fill_(pruned, 0.0)
                weights[name] = W
            rows = report.layer_rows(weights, job.arch.layers)
            return {"sparsity": report.overall(rows), "rows": rows}, {}

        return process

    def summary(self, layer_summaries: list[dict], out_dir: Path, progress: Progress) -> dict[str, Any]:
        from geminicompress.compress.prune import report

        rows = [r for s in layer_summaries for r in s.get("rows", [])]
        achieved = report.overall(rows)
        cfg = self.cfg
        title = f"magnitude {cfg.pattern or cfg.scope}: {achieved:.2%} of {sum(r['params'] for r in rows):,} weights"
        report.write_histogram(rows, out_dir / "prune_sparsity.png", title)
        high = [r for r in rows if r["sparsity"] > report.HIGH]
        progress.info(f"pruned {achieved:.2%} of {len(rows)} linear layers' weights (magnitude, {cfg.pattern or cfg.scope})")
        value = self.threshold["value"] if self.threshold else None
        return {"method": "magnitude", "scope": cfg.scope, "pattern": cfg.pattern,
                "requested_sparsity": self.pattern[0] / self.pattern[1] if self.pattern else cfg.sparsity,
                "achieved_sparsity": round(achieved, 6), "prunable_params": sum(r["params"] for r in rows),
                "pruned_params": sum(r["zeros"] for r in rows),
                "threshold": value if value is not None and math.isfinite(value) else None,
                "layers_over_90pct": [r["name"] for r in high], "masks_file": None,
                "histogram_file": "prune_sparsity.png", "layers": rows, "streamed": True}
