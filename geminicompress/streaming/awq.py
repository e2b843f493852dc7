"""Streamed AWQ and AWQ+GPTQ: the in-memory stage's `_awq_layer` per layer (search, fold, clip, quantize),
packed per layer into the output (AWQ GEMM, compressed-tensors pack-quantized) or written dense.

The search results (scales and clips, small) of each finished layer go into the state folder, so a
resumed run still writes the whole OUT/awq_search/ at the end, as the in-memory stage does.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from geminicompress.compress.grid import QuantizedWeight
from geminicompress.engine.layers import LayerFn
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.progress import Progress
from geminicompress.streaming.output import DenseOutput, PackedOutput
from geminicompress.streaming.stage import Done


class StreamedAWQ:
    calibrated = True

    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, out_dtype: torch.dtype, state_dir: Path,
                 progress: Progress) -> None:
        from geminicompress.compress.awq import results
        from geminicompress.compress.awq.stage import _awq_layer
        from geminicompress.compress.targets import weight_quant_targets
        from geminicompress.formats.checkpoint import scale_dtype

        self.cfg, self.ckpt, self.out_dtype = cfg, ckpt, out_dtype
        # the in-memory stage's opening: targets, the spec, the format check, a saved search
        found = weight_quant_targets(ckpt.model, cfg, progress, sym=not cfg.zero_point, fmt=cfg.format)
        self.spec, self.targets = found.spec, found.names
        saved = results.load_search(cfg.search_results, ckpt.model.config.model_type, len(ckpt.layers))[0] \
            if cfg.search_results else None
        self.layers_path = ckpt.arch.layers + "."
        self.process = partial(_awq_layer, cfg=cfg, spec=self.spec, saved=saved, norm_offset=ckpt.arch.norm_offset,
                               scales_as=scale_dtype(cfg.format, str(out_dtype).removeprefix("torch.")),
                               targets={n.removeprefix(self.layers_path) for n in self.targets})
        self.search_dir = state_dir / "awq_search"
        self.search_dir.mkdir(parents=True, exist_ok=True)

    def layer_fn(self) -> LayerFn:
        return self.process

    def finish_layer(self, i: int, kept: dict[str, torch.Tensor]) -> None:
        """Keep layer i's search results (scales, clips) in the state folder until the end."""
        from geminicompress.compress.awq import results

        found = results.search_tensors({f"{i}.{k}": v for k, v in kept.items()})
        save_file({k: v.contiguous() for k, v in found.items()}, str(self.search_dir / f"layer_{i:05d}.safetensors"))

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> Mapping[str, QuantizedWeight]:
        from geminicompress.compress.awq.stage import _qweights

        return _qweights({f"{i}.{k}": v for k, v in kept.items()}, self.spec, self.layers_path)

    def output(self) -> DenseOutput:
        from geminicompress.compress.awq.stage import export_meta

        if self.cfg.format == "dense":
            return DenseOutput(self.ckpt, self.out_dtype)
        meta = export_meta(self.cfg, str(self.out_dtype).removeprefix("torch."))
        return PackedOutput(self.ckpt, self.out_dtype, self.cfg.format, self.spec, self.targets, meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        from geminicompress.compress.awq import results
        from geminicompress.compress.awq.stage import search_meta, summary

        tensors: dict[str, torch.Tensor] = {}
        for i in range(len(self.ckpt.layers)):
            tensors.update(load_file(str(self.search_dir / f"layer_{i:05d}.safetensors")))
        meta = search_meta(self.cfg, self.ckpt.model.config.model_type, len(self.ckpt.layers), self.spec, done.windows)
        results.save_search(done.out_dir, tensors, meta)
        return {**summary(self.cfg, self.spec, done.windows, len(self.targets), layers), "streamed": True}
