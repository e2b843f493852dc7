"""Running layer stages: a walk of stages over a layer source into a sink, and the walk that writes OUT.

A model in memory and a streamed one differ only in what is plugged in (pipeline.py decides):
- in memory, each layer stage walks the resident model (`ModelLayers`) into a `ResidentSink` (its layers stay
  in the model; a calibrated stage's finished layers are its resume state), then one more walk, with no
  stage, writes OUT through a `ShardSink`;
- streamed, the stages' per-layer functions are composed (layer i gets every stage before layer i+1 is read)
  and one walk over the checkpoint read layer by layer (`models.lazy.LazyLayers`) writes OUT as it goes.
Either way OUT is written by the same `ShardSink` and the same per-layer writer of its format (formats/), a
probe may run through every layer as it is written (verify.py), and the modules outside the decoder layers
follow the layers (walk.walk_outside).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from geminicompress.engine.compose import compose
from geminicompress.engine.contract import Done, LayerStage, StageContext, stage_kept, walk_dtypes
from geminicompress.engine.sinks import ResidentSink
from geminicompress.engine.walk import ModelLayers, nothing, run_layerwise, walk_outside, WalkOptions
from geminicompress.formats.shards import ShardWriter
from geminicompress.host.memory import release_weights
from geminicompress.runtime.methods import method_of


@dataclass
class Walked:
    """What a walk of some stages left: per stage, its per-layer summaries and the kept tensors the sink
    retained ("<layer>.<name>"); the modules outside the layers' rows; the calibration windows and dtypes."""

    summaries: list[list[dict]]
    kept: list[dict[str, torch.Tensor]]
    outside_rows: list[dict] = field(default_factory=list)
    windows: torch.Tensor | None = None
    dtypes: tuple[torch.dtype, torch.dtype] | None = None
    seconds: float = 0.0

    def done(self, k: int, ctx: StageContext) -> Done:
        """What stage k's summary reads."""
        return Done(ctx.out_dir, ctx.progress, windows=self.windows, calibration_data=ctx.recipe.calibration.data,
                    outside_rows=self.outside_rows, kept=self.kept[k],
                    calib_dtype=self.dtypes[0] if self.dtypes is not None else None)


def make_stage(cfg: Any, ctx: StageContext) -> LayerStage:
    """The layer stage of `cfg` (its method's), opened: bad input fails here, before any work."""
    return method_of(cfg).stage(cfg, ctx)


def run_stage(cfg: Any, ctx: StageContext, description: str | None = None, last: bool = False
              ) -> tuple[LayerStage, dict[str, Any], dict[str, torch.Tensor]]:
    """A layer stage on the model in memory (`ctx.model`): one walk whose finished layers stay in the model, a
    calibrated stage's also saved in `ctx.state_dir` to resume from. Returns (the stage, its summary, the kept
    tensors of every layer, "<layer>.<name>"). `last`: the run's last stage on a model it owns: the float
    weights its kept codes make again exactly are dropped as each layer finishes (`releaser`)."""
    if ctx.layers is None:
        ctx.layers = ModelLayers(ctx.model)
    stage = make_stage(cfg, ctx)
    resume = ShardWriter(ctx.state_dir / "layers") if stage.calibrated else None
    sink = ResidentSink(ctx.model, resume, release=releaser(stage) if last else None)
    walked = walk(ctx, [stage], sink, description or method_of(cfg).describe(cfg))
    return stage, stage.summary(walked.summaries[0], walked.done(0, ctx)), walked.kept[0]


def releaser(stage: LayerStage) -> Any:
    """What drops a finished layer's quantized float weights, for a stage whose writer packs them from the kept
    codes (GPTQ, AWQ, RTN): nothing after the stage reads them, except the check's probe, which makes them
    again from the codes one layer at a time (engine/verify.py). On the demo's 4-bit GPTQ the finished layers'
    float32 weights were 0.4 GB of the run's peak. None for a stage that writes floats or modules."""
    writer = stage.writer()
    if writer is None:
        return None

    def release(i: int, layer: Any, kept: dict[str, torch.Tensor]) -> None:
        release_weights(layer, writer.exact_weights(i, kept))

    return release


def walk(ctx: StageContext, stages: list[LayerStage], sink: Any, description: str) -> Walked:
    """Every decoder layer of the run's source through `stages` (composed) into `sink`, then the modules
    outside the layers through the stages' `outside` hooks into the sink."""
    t0 = time.perf_counter()
    n = len(stages)
    dtypes = walk_dtypes(stages)
    windows = None
    if dtypes is not None:
        windows = ctx.calibration(next((s.cfg.data for s in stages if s.calibrated and s.cfg.data), None))
    source = ctx.layers.reading_in(dtypes[1] if dtypes is not None else None)
    fn = compose(*[s.layer_fn() for s in stages]) if stages else nothing
    done = run_layerwise(source, windows, fn, WalkOptions(device=ctx.device, progress=ctx.progress,
                                                          description=description,
                                                          calib_dtype=dtypes[0] if dtypes is not None else None,
                                                          sink=sink))
    hooks = [s.outside for s in stages]
    rows = walk_outside(source, hooks, sink)
    per_stage_summaries = [[{"layer": x["layer"], **stage_kept(x, k, n)} for x in done.summaries] for k in range(n)]
    per_stage_kept = [_stage_kept_all(done.kept, k, n) for k in range(n)]
    return Walked(per_stage_summaries, per_stage_kept, rows, windows, dtypes, time.perf_counter() - t0)


def _stage_kept_all(kept: dict[str, torch.Tensor], k: int, n: int) -> dict[str, torch.Tensor]:
    """Stage k's entries of a walk's kept tensors ("<layer>.<stage>.<name>" -> "<layer>.<name>")."""
    if n == 1:
        return kept
    parts = ((key.split(".", 2), value) for key, value in kept.items())
    return {f"{layer}.{name}": value for (layer, stage, name), value in parts if stage == str(k)}
