"""Streamed round-to-nearest: the in-memory stage's `quantize_linear` on each decoder linear of a layer,
packed per layer into the output (gptq, awq, compressed-tensors) or written dense. No calibration."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from geminicompress.compress.grid import QuantizedWeight
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.progress import Progress
from geminicompress.streaming.output import DenseOutput, PackedOutput
from geminicompress.streaming.stage import Done

FIELDS = ("q", "scales", "zeros", "g_idx")


class StreamedRTN:
    calibrated = False

    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype, progress: Progress) -> None:
        from geminicompress.compress.targets import weight_quant_targets
        from geminicompress.formats.checkpoint import scale_dtype

        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        found = weight_quant_targets(ckpt.model, cfg, progress, sym=cfg.sym, fmt=cfg.format)  # as in memory
        self.spec, self.targets, self.target_set = found.spec, found.names, set(found.names)
        self.scales_as = scale_dtype(cfg.format, str(out_dtype).removeprefix("torch."))

    def layer_fn(self) -> LayerFn:
        from geminicompress.compress.rtn import quantize_linear

        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            prefix = f"{job.arch.layers}.{job.index}"
            kept: dict[str, torch.Tensor] = {}
            errors = []
            for n in job.arch.linears:
                if f"{prefix}.{n}" in self.target_set:
                    qw, err = quantize_linear(job.module(n).weight, self.spec, self.scales_as)
                    kept.update({f"{n}.{f}": getattr(qw, f) for f in FIELDS})
                    errors.append(err)
            return {"errors": errors}, kept

        return process

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> Mapping[str, QuantizedWeight]:
        prefix = self.ckpt.layer_prefix(i)
        names = dict.fromkeys(k.rsplit(".", 1)[0] for k in kept)
        return {f"{prefix}.{n}": QuantizedWeight(*(kept[f"{n}.{f}"] for f in FIELDS), self.spec) for n in names}

    def output(self) -> DenseOutput:
        from geminicompress.compress.rtn import export_meta

        if self.cfg.format == "dense":
            return DenseOutput(self.ckpt, self.out_dtype)
        meta = export_meta(self.cfg, str(self.out_dtype).removeprefix("torch."))
        return PackedOutput(self.ckpt, self.out_dtype, self.cfg.format, self.spec, self.targets, meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        from geminicompress.compress.rtn import summary

        errors = [e for s in layers for e in s.get("errors", [])]
        return {**summary(self.cfg, self.spec, len(self.targets), errors), "streamed": True}
