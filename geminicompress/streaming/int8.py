"""Streamed int8/w8a8 (without SmoothQuant): each targeted linear swapped for its INT8 module per layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.arch import get_module, set_module
from geminicompress.compress.layerwise import LayerFn, LayerJob
from geminicompress.errors import InputError
from geminicompress.models.lazy import LazyCheckpoint


class StreamedInt8:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint) -> None:
        from geminicompress.compress.int8.stage import select_linears

        self.cfg, self.ckpt = cfg, ckpt
        self.targets, self.kept = select_linears(ckpt.model, cfg.ignore, explicit="ignore" in cfg.model_fields_set)
        if ckpt.tied_output and ckpt.tied_output not in self.kept:  # the meta skeleton is not tied: say it
            self.kept[ckpt.tied_output] = "output head tied to the input embeddings"
            self.targets = [t for t in self.targets if t != ckpt.tied_output]
        if not self.targets:
            raise InputError("the ignore patterns leave no linear layer to quantize")

    def quantize(self, root: nn.Module, prefix: str) -> list[dict[str, Any]]:
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
                         "smoothquant_max_scale": None, "weight_rel_error": round(err, 6), "module": module})
        return rows

    def layer_fn(self) -> LayerFn:
        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            rows = self.quantize(job.layer, f"{job.arch.layers}.{job.index}")
            return {"quantized": len(rows), "int8_rows": [public_row(r) for r in rows]}, {}

        return process

    def summary(self, layer_summaries: list[dict], outside_rows: list[dict]) -> dict[str, Any]:
        rows = [r for s in layer_summaries for r in s.get("int8_rows", [])] + outside_rows
        return {"method": self.cfg.method, "weights": "int8 symmetric per output channel",
                "activations": "int8 dynamic per token" if self.cfg.method == "w8a8" else "float (weight-only)",
                "quantized": len(rows), "kept_float": self.kept, "smoothquant": {"alpha": None}, "layers": rows,
                "streamed": True}


def public_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "module"}
