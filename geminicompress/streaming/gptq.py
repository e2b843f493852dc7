"""Streamed GPTQ: the in-memory stage's `_quantize_layer` per layer, packed per layer into the output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.layerwise import LayerFn
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.progress import Progress
from geminicompress.streaming.sink import module_tensors


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

    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype, progress: Progress) -> None:
        from functools import partial

        from geminicompress.compress.gptq.stage import _quantize_layer
        from geminicompress.compress.targets import weight_quant_targets
        from geminicompress.formats.checkpoint import scale_dtype

        self.calib_dtype, self.layer_dtype = gptq_dtypes(cfg, ckpt, out_dtype)
        cfg = cfg.model_copy(update={"calib_dtype": str(self.calib_dtype).removeprefix("torch.")})
        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        # the in-memory stage's opening: targets, shapes, the spec (group size "auto" resolved), format check
        targets = weight_quant_targets(ckpt.model, cfg, progress, sym=cfg.sym, fmt=cfg.format)
        self.spec, self.targets, self.shapes = targets.spec, targets.names, targets.shapes
        self.layers_path = ckpt.arch.layers + "."
        scales_as = scale_dtype(cfg.format, str(out_dtype).removeprefix("torch."))
        self.process = partial(_quantize_layer, cfg=cfg, spec=self.spec, scales_as=scales_as,
                               targets={n.removeprefix(self.layers_path) for n in self.targets})

    def layer_fn(self) -> LayerFn:
        return self.process

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's float tensors and, for the gptq format, its quantized linears packed (qweight, ...)."""
        from geminicompress.compress.gptq.stage import _KeptCodes
        from geminicompress.formats.gptq import pack_gptq

        tensors = module_tensors(self.ckpt.layer_prefix(i), layer, self.out_dtype)
        if self.cfg.format == "dense":  # the fake-quantized weights are the layer's own
            return tensors
        qweights = _KeptCodes({f"{i}.{k}": v for k, v in kept.items()}, self.spec, self.layers_path)
        for name in qweights:
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": v for k, v in pack_gptq(qweights[name]).items()})
        return tensors

    @torch.no_grad()
    def load_back(self, i: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put a finished layer's written tensors back into it (its quantized linears dequantized: the
        same float32 weights the run computed with, since the scales were rounded to the stored dtype)."""
        from geminicompress.formats.gptq import SUFFIXES, unpack_gptq

        prefix = self.ckpt.layer_prefix(i) + "."
        params = dict(layer.named_parameters())
        for name in [n for n in self.targets if n.startswith(prefix)] if self.cfg.format == "gptq" else []:
            packed = {k: tensors.pop(f"{name}.{k}") for k in SUFFIXES}
            rel = name[len(prefix):] + ".weight"
            params[rel].copy_(unpack_gptq(packed, self.spec).dequantize().to(params[rel].dtype))
        for key, value in tensors.items():
            params[key[len(prefix):]].copy_(value.to(params[key[len(prefix):]].dtype))

    def write_config(self, out: Path) -> None:
        from geminicompress import __version__ as version
        from geminicompress.formats.checkpoint import write_config
        from geminicompress.formats.gptq import gptq_config

        if self.cfg.format == "dense":
            write_config(self.ckpt.model, out, None, self.out_dtype)
            return
        cfg = self.cfg
        meta = {"act_order": cfg.act_order, "static_groups": cfg.static_groups, "true_sequential": cfg.true_sequential,
                "damp": cfg.damp, "version": version}
        layer_linears = [n for n, m in self.ckpt.model.named_modules()
                         if isinstance(m, nn.Linear) and n.startswith(self.layers_path)]
        qconfig = gptq_config(self.spec, meta, [n for n in layer_linears if n not in self.targets])
        write_config(self.ckpt.model, out, qconfig, self.out_dtype)
        quantize_config = {k: v for k, v in qconfig.items() if k not in ("meta", "dynamic")}
        (out / "quantize_config.json").write_text(json.dumps(quantize_config, indent=2) + "\n")

    def summary(self, layer_summaries: list[dict], windows: torch.Tensor) -> dict[str, Any]:
        return {"bits": self.spec.bits, "group_size": self.spec.group_size, "sym": self.spec.sym,
                "format": self.cfg.format, "calibration_tokens": int(windows.numel()),
                "calib_dtype": self.cfg.calib_dtype, "layer_dtype": str(self.layer_dtype).removeprefix("torch."),
                "quantized_modules": len(self.targets), "total_error": sum(s.get("err", 0.0) for s in layer_summaries),
                "layers": layer_summaries, "streamed": True}
