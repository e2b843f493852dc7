"""The streamed run's layer sink: finished layers go into the output shards and leave memory."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from geminicompress.errors import GeminiError
from geminicompress.formats.shards import ShardWriter


class ShardSink:
    """Finished layers go into output shards as `tensors_of(i, layer, kept)` and leave memory. To resume a
    calibrated run through a finished layer, `load_back(i, layer, tensors)` puts what was written back
    into the layer (the next layer's inputs are computed through it)."""

    restores_weights = False

    def __init__(self, writer: ShardWriter,
                 tensors_of: Callable[[int, nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 load_back: Callable[[int, nn.Module, dict[str, torch.Tensor]], None] | None = None) -> None:
        self.writer, self.tensors_of, self.load_back = writer, tensors_of, load_back

    def finished(self, i: int) -> bool:
        return self.writer.finished(f"layer.{i}")

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]:
        if layer is not None:
            if self.load_back is None:
                raise GeminiError("this streamed run cannot resume through a finished layer; rerun with --force")
            self.load_back(i, layer, self.writer.read(f"layer.{i}"))
        return self.writer.summary(f"layer.{i}"), {}

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.writer.write(f"layer.{i}", self.tensors_of(i, layer, kept), summary)
        return {}


def module_tensors(prefix: str, module: nn.Module, dtype: torch.dtype,
                   skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """A module's state dict under `prefix`, floating tensors in `dtype` (what save_pretrained writes);
    `skip`: names (relative to the module) the caller writes another way (packed linears' weights)."""
    return {f"{prefix}.{k}": (v.to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in module.state_dict().items() if k not in skip}
