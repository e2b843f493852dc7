"""Streamed GPTQ: the in-memory stage's `_quantize_layer` per layer, packed per layer into the output
(gptq v1, compressed-tensors pack-quantized) or written dense."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from geminicompress.engine.compose import OnePassFn
from geminicompress.compress.grid import QuantizedWeight
from geminicompress.engine.layers import LayerFn
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.progress import Progress
from geminicompress.streaming.output import DenseOutput, PackedOutput
from geminicompress.streaming.stage import Done


def gptq_dtypes(cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the layers compute in while calibrating, dtype of the weights the solver reads and writes).

    A bfloat16 checkpoint calibrates in bfloat16 unless --calib-dtype says otherwise: its activations
    take half the memory (32 x 512 windows of an 8B model: 0.9 instead of 1.7 GB held in one pass). When
    the output is bfloat16 too, float32 master weights would only hold values that are rounded to the
    bfloat16 the layer computes with anyway (the input exactly, the solved weights when written), so the
    layer stays bfloat16: the same tensors as the in-memory `--calib-dtype bfloat16` run, bitwise (tested).
    Otherwise the layer is float32, as in memory."""
    calib = getattr(torch, cfg.calib_dtype)
    if "calib_dtype" not in cfg.model_fields_set and ckpt.dtype == torch.bfloat16:
        calib = torch.bfloat16
    exact = calib == out_dtype == ckpt.dtype == torch.bfloat16
    return calib, torch.bfloat16 if exact else torch.float32


class StreamedGPTQ:
    """GPTQ per layer (the in-memory stage's own `_quantize_layer`), packed per layer into the output."""

    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype, progress: Progress,
                 dtypes: tuple[torch.dtype, torch.dtype] | None = None) -> None:
        from functools import partial

        from geminicompress.compress.gptq.stage import _quantize_layer
        from geminicompress.compress.targets import weight_quant_targets
        from geminicompress.formats.checkpoint import scale_dtype

        # (compute, held) dtypes of the layers: the run's (plan.py), by default GPTQ's own
        self.calib_dtype, self.layer_dtype = dtypes or gptq_dtypes(cfg, ckpt, out_dtype)
        cfg = cfg.model_copy(update={"calib_dtype": str(self.calib_dtype).removeprefix("torch.")})
        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        # the in-memory stage's opening: targets, shapes, the spec (group size "auto" resolved), format check
        targets = weight_quant_targets(ckpt.model, cfg, progress, sym=cfg.sym, fmt=cfg.format)
        self.spec, self.targets, self.shapes = targets.spec, targets.names, targets.shapes
        self.layers_path = ckpt.arch.layers + "."
        scales_as = scale_dtype(cfg.format, str(out_dtype).removeprefix("torch."))
        self.process = partial(_quantize_layer, cfg=cfg, spec=self.spec, scales_as=scales_as,
                               targets={n.removeprefix(self.layers_path) for n in self.targets})

    calibrated = True

    def layer_fn(self) -> LayerFn:
        """The in-memory step; with true-sequential in one pass it shares that pass with a one-pass stage
        before it (e.g. SparseGPT: compose.py)."""
        return OnePassFn(self.process) if self.cfg.true_sequential and self.cfg.one_pass else self.process

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> Mapping[str, QuantizedWeight]:
        """Layer i's quantized linears from the codes the step kept (packed one module at a time)."""
        from geminicompress.compress.gptq.stage import _KeptCodes

        return _KeptCodes({f"{i}.{k}": v for k, v in kept.items()}, self.spec, self.layers_path)

    def output(self) -> DenseOutput:
        from geminicompress.compress.gptq.stage import export_meta

        if self.cfg.format == "dense":  # the fake-quantized weights are the layer's own
            return DenseOutput(self.ckpt, self.out_dtype)
        meta = export_meta(self.cfg, str(self.out_dtype).removeprefix("torch."))
        return PackedOutput(self.ckpt, self.out_dtype, self.cfg.format, self.spec, self.targets, meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        return {"bits": self.spec.bits, "group_size": self.spec.group_size, "sym": self.spec.sym,
                "format": self.cfg.format, "calibration_tokens": int(done.windows.numel()),
                "calib_dtype": str(self.calib_dtype).removeprefix("torch."),
                "layer_dtype": str(self.layer_dtype).removeprefix("torch."),
                "quantized_modules": len(self.targets), "total_error": sum(s.get("err", 0.0) for s in layers),
                "layers": layers, "streamed": True}
