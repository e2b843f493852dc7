"""What a streamed stage is: the in-memory stage's per-layer function plus what the streamed run needs
around it (its calibration, the format it writes, its result for report.json).

Every adapter (`prune.py`, `int8.py`, `gptq.py`, `awq.py`) opens the way its in-memory stage opens
(targets, spec, checks: the same functions) and hands `run_layerwise` that stage's own per-layer
function; none implements a method a second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from geminicompress.engine.layers import LayerFn
from geminicompress.progress import Progress
from geminicompress.streaming.output import DenseOutput


@dataclass
class Done:
    """What a stage's summary may read once every layer is written."""

    out_dir: Path
    progress: Progress
    windows: torch.Tensor | None = None  # the calibration windows (n, T), for calibrated runs
    calibration_data: str = ""  # the recipe's calibration DATA (a stage's own `data` wins)
    outside_rows: list[dict] = field(default_factory=list)  # int8: the modules outside the layers


class StreamedStage(Protocol):
    """An adapter may also have `finish_layer(i, kept)`: called with its kept tensors of layer i just
    before the layer is written (AWQ keeps its search results that way)."""

    cfg: Any
    calibrated: bool  # needs the layer's inputs on the calibration windows

    def layer_fn(self) -> LayerFn: ...

    def output(self) -> DenseOutput | None: ...  # the format it writes (None: it leaves the previous one's)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]: ...


def stage_kept(kept: dict[str, torch.Tensor], k: int, n: int) -> dict[str, torch.Tensor]:
    """Stage k's own kept tensors (or summary entries) of a composed LayerFn over n stages."""
    if n == 1:
        return kept
    head = f"{k}."
    return {key[len(head):]: v for key, v in kept.items() if key.startswith(head)}
