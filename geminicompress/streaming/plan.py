"""What a streamed recipe needs before any layer is read: one adapter per stage (an explicit table), and
for calibrated recipes the dtypes the layers compute and are held in, read from the stages' options.

Dtypes: the in-memory path holds the model in float32, so a calibrated stage computes in float32 here
too (the layers read from a bf16 checkpoint are cast; the results are then the in-memory run's with
`--dtype bfloat16`, tested bitwise). GPTQ alone may compute in bfloat16 (`gptq.gptq_dtypes`). With
several calibrated stages on one layer, the layer computes in float32: the stages write the weights
the layer computes with, so there must be no second, lower-precision copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.progress import Progress
from geminicompress.recipes.schema import stage_tag
from geminicompress.streaming.awq import StreamedAWQ
from geminicompress.streaming.decide import calibrated
from geminicompress.streaming.estimate import Calibration
from geminicompress.streaming.gptq import StreamedGPTQ, gptq_dtypes
from geminicompress.streaming.int8 import StreamedInt8
from geminicompress.streaming.prune import StreamedPrune
from geminicompress.streaming.rtn import StreamedRTN
from geminicompress.streaming.stage import StreamedStage

# stage tag -> adapter(cfg, ckpt, output dtype, state folder, progress, the run's calibration dtypes or None)
Maker = Callable[[Any, LazyCheckpoint, torch.dtype, Path, Progress, "tuple[torch.dtype, torch.dtype] | None"],
                 StreamedStage]
STAGES: dict[str, Maker] = {
    "prune": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedPrune(cfg, ckpt, dtype, state, progress),
    "quantize:int8": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedInt8(cfg, ckpt, dtype),
    "quantize:w8a8": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedInt8(cfg, ckpt, dtype),
    "quantize:gptq": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedGPTQ(cfg, ckpt, dtype, progress, dtypes),
    "quantize:awq": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedAWQ(cfg, ckpt, dtype, state, progress),
    "quantize:awq+gptq": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedAWQ(cfg, ckpt, dtype, state, progress),
    "quantize:rtn": lambda cfg, ckpt, dtype, state, progress, dtypes: StreamedRTN(cfg, ckpt, dtype, progress),
}

# float32 (widest input)² buffers a calibrated stage holds at its peak (Hessians, solver scratch). GPTQ:
# the accumulator, which the in-place inverse factor uses as its scratch (compress/hessian.py);
# SparseGPT: the accumulator (shared by a group's linears) and the factor computed in a copy of it
SQUARES = {"sparsegpt": 2, "wanda": 0, "w8a8": 0, "gptq": 1, "awq": 2, "awq+gptq": 2}


def calibration(stages: list[Any], ckpt: LazyCheckpoint, out_dtype: torch.dtype,
                windows: tuple[int, int]) -> Calibration | None:
    """How the layers are held while calibrating (None: no stage calibrates)."""
    mine = [s for s in stages if calibrated(s)]
    if not mine:
        return None
    if len(mine) == 1 and mine[0].method == "gptq":
        calib, held = gptq_dtypes(mine[0], ckpt, out_dtype)
    else:
        calib = held = torch.float32
    one_pass = any(s.true_sequential and getattr(s, "one_pass", True) for s in mine
                   if s.method in ("wanda", "sparsegpt", "gptq"))
    return Calibration(windows, calib, held, one_pass, sum(SQUARES[s.method] for s in mine))


def make_stages(stages: list[Any], ckpt: LazyCheckpoint, out_dtype: torch.dtype, state: Path, progress: Progress,
                calib: Calibration | None) -> list[StreamedStage]:
    dtypes = (calib.calib_dtype, calib.layer_dtype) if calib is not None else None
    return [STAGES[stage_tag(s)](s, ckpt, out_dtype, state, progress, dtypes) for s in stages]
