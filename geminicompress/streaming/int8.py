"""Streamed int8/w8a8: each targeted linear swapped for its INT8 module, layer by layer; with SmoothQuant
(w8a8), the layer's activation maxima first, from the layer's inputs, then the scales folded in.

SmoothQuant equals the in-memory stage, which takes its statistic on the *float* model in one
whole-model pass before anything is smoothed: here each layer's statistic comes from the float
(unsmoothed, unquantized) layer's inputs, and the float layer's outputs, computed in the same pass,
are the next layer's inputs (`job.output_batches`), not the quantized layer's. Same windows one at a
time, same per-window maximum, same mean (`smoothquant.window_max`), same fold (`smoothquant.smooth_group`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.arch import get_module, set_module
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.errors import InputError
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.streaming.output import Int8Output
from geminicompress.streaming.stage import Done


class StreamedInt8:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype) -> None:
        from geminicompress.compress.int8 import smoothquant as sq
        from geminicompress.compress.int8.stage import select_linears

        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        self.targets, self.kept = select_linears(ckpt.model, cfg.ignore, explicit="ignore" in cfg.model_fields_set)
        if ckpt.tied_output and ckpt.tied_output not in self.kept:  # the meta skeleton is not tied: say it
            self.kept[ckpt.tied_output] = "output head tied to the input embeddings"
            self.targets = [t for t in self.targets if t != ckpt.tied_output]
        if not self.targets:
            raise InputError("the ignore patterns leave no linear layer to quantize")
        self.calibrated = cfg.smoothquant_alpha is not None
        self.groups, self.skipped = sq.foldable_groups(ckpt.model, ckpt.arch, set(self.targets)) if self.calibrated else ([], [])

    def quantize(self, root: nn.Module, prefix: str, smoothed: dict[str, float] | None = None) -> list[dict[str, Any]]:
        """Swap every targeted linear under module `root` (named `prefix` in the model) for its INT8 module."""
        from geminicompress.compress.int8.modules import MODULES
        from geminicompress.compress.int8.stage import _relative_error

        rows = []
        head = f"{prefix}." if prefix else ""
        for full in self.targets:
            if not (full == prefix or full.startswith(head)):
                continue
            rel = full[len(head):]
            linear = get_module(root, rel) if rel else root
            module = MODULES[self.cfg.method].from_linear(linear)
            err = _relative_error(linear.weight, module.dequantized_weight())
            if rel:
                set_module(root, rel, module)
            rows.append({"name": full, "shape": [module.out_features, module.in_features], "kernel": module.kernel,
                         "smoothquant_max_scale": (smoothed or {}).get(full), "weight_rel_error": round(err, 6),
                         "module": module})
        return rows

    @torch.no_grad()
    def _smooth(self, job: LayerJob) -> dict[str, float]:
        """SmoothQuant on one layer: statistic from the float layer's inputs, its outputs kept for the next
        layer, scales folded. Returns {linear: largest scale} as the in-memory stage reports it."""
        from geminicompress.compress.int8 import smoothquant as sq

        head = f"{job.arch.layers}.{job.index}."
        groups = [g for g in self.groups if g.prev.startswith(head)]
        sums: dict[str, torch.Tensor] = {}

        def record(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
            m = sq.window_max(x)  # one window: x (1, T, in)
            sums[name] = sums[name] + m if name in sums else m

        first = {g.linears[0] for g in groups}
        observe = {job.module(n[len(head):]): (lambda x, y, n=n: record(n, x, y)) for n in first}
        job.output_batches = job.forward(observe, keep_outputs=True)  # the float layer's outputs, one per window
        windows = len(job.inputs.hidden)
        smoothed: dict[str, float] = {}
        for g in groups:
            top = sq.smooth_group(job.module(g.prev[len(head):]), [job.module(n[len(head):]) for n in g.linears],
                                  (sums[g.linears[0]] / windows).cpu(), self.cfg.smoothquant_alpha,
                                  job.arch.norm_offset)
            smoothed.update({n: top for n in g.linears})
        return smoothed

    def layer_fn(self) -> LayerFn:
        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            smoothed = self._smooth(job) if self.calibrated else None
            rows = self.quantize(job.layer, f"{job.arch.layers}.{job.index}", smoothed)
            return {"quantized": len(rows), "int8_rows": [public_row(r) for r in rows]}, {}

        return process

    def output(self) -> Int8Output:
        return Int8Output(self.ckpt, self.out_dtype, self.cfg.method, self.targets)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        from geminicompress.compress.int8.stage import smoothing_summary

        rows = [r for s in layers for r in s.get("int8_rows", [])] + done.outside_rows
        smoothing: dict[str, Any] = {"alpha": None}
        if self.calibrated:
            smoothing = smoothing_summary(self.cfg, done.calibration_data, done.windows, len(self.groups), self.skipped)
        return {"method": self.cfg.method, "weights": "int8 symmetric per output channel",
                "activations": "int8 dynamic per token" if self.cfg.method == "w8a8" else "float (weight-only)",
                "quantized": len(rows), "kept_float": self.kept, "smoothquant": smoothing, "layers": rows,
                "streamed": True}


def public_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "module"}
