"""OUT's one export path, for in-memory and streamed runs alike (issue #35).

`open_export` builds, once, what writes OUT: the writer of OUT's format (that of the last stage that sets
one, else the dense checkpoint: formats/), the probe that checks OUT (verify.py), OUT's shards and the sink
that writes each finished layer into them (sinks.ShardSink). The two kinds of run differ only in what the
sink is told: in memory, the stages have run already and the sink writes the model's layers with the codes
the writing stage kept; streamed, every stage runs in the walk that writes, so the sink also holds what a
resumed run needs (the kept tensors, the exact inputs, how to put a written layer back).

`finish_export` then writes OUT's other files (config.json, the tokenizer), checks OUT, and writes
OUT/model.gguf when a stage asks for `format: gguf`: GGUF is one more format here (formats/gguf_export.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geminicompress.engine.contract import LayerStage, StageContext, layer_kept, stage_kept, walk_dtypes
from geminicompress.engine.sinks import InputsKeeper, Resume, ShardSink
from geminicompress.engine.verify import Probe
from geminicompress.formats.shards import ShardWriter
from geminicompress.formats.writer import LayerWriter
from geminicompress.host.output import final_name


@dataclass(frozen=True)
class Export:
    """What writes OUT: the format's writer, the probe (None with --no-verify), OUT's shards, the sink."""

    writer: LayerWriter
    probe: Probe | None
    shards: ShardWriter
    sink: ShardSink


def writing_stage(stages: list[LayerStage]) -> int | None:
    """The index of the stage whose format OUT takes: the last that sets one (None: dense)."""
    return max((k for k, s in enumerate(stages) if s.writer() is not None), default=None)


def open_export(ctx: StageContext, stages: list[LayerStage], verify: bool, max_shard: int,
                kept: dict[str, torch.Tensor] | None = None) -> Export:
    """Writer, probe, shards and sink of a run; `ctx.state_dir` holds the shards (the resume state).

    In memory (`ctx.streamed` false): `stages` have run on the model; `kept` holds the writing stage's kept
    tensors of every layer ("<layer>.<name>"). Streamed: `stages` run in the walk that writes OUT, and the
    probe is made here, before any layer is read."""
    owner = writing_stage(stages)
    writer = stages[owner].writer() if owner is not None else LayerWriter(ctx.model, ctx.out_dtype)
    probe = None
    if verify:
        probe = (Probe(ctx.layers, ctx.tokenizer, ctx.out_dtype, ctx.device) if ctx.streamed else
                 Probe(ctx.layers, ctx.tokenizer, ctx.out_dtype, ctx.device, unrounded=True,
                       made=lambda i: writer.exact_weights(i, layer_kept(kept or {}, i))))
    shards = ShardWriter(ctx.state_dir / "shards", max_shard)
    if not ctx.streamed:
        kept = kept if kept is not None else {}
        sink = ShardSink(shards, writer, lambda i, _: layer_kept(kept, i), probe=probe, computed=True)
        return Export(writer, probe, shards, sink)
    n = len(stages)
    retain = retain_of(stages)
    dtypes = walk_dtypes(stages)
    # the written layers give the next inputs back exactly unless a stage changed float weights that are written
    # in a lower dtype than they were computed in: then the exact inputs are kept with the resume state
    inexact = dtypes is not None and dtypes[1] != ctx.out_dtype and any(s.rounds_floats for s in stages)
    load_back = load_back_of(stages, writer)
    resume = Resume(load_back=load_back, retain=retain, rebuild=load_back if load_back == writer.load_back else None,
                    kept_writer=ShardWriter(ctx.state_dir / "kept") if retain is not None else None,
                    inputs=InputsKeeper(ctx.state_dir / "inputs") if inexact else None)
    sink = ShardSink(shards, writer, (lambda i, kept: stage_kept(kept, owner, n)) if owner is not None else
                     (lambda i, kept: {}), probe=probe, resume=resume)
    return Export(writer, probe, shards, sink)


def retain_of(stages: list[LayerStage]) -> Callable[[dict], dict] | None:
    """What a streamed walk must hold of each finished layer's kept tensors until the summaries."""
    if not any(s.retains for s in stages):
        return None
    n = len(stages)

    def retain(kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, s in enumerate(stages):
            if s.retains:
                mine = s.retain(stage_kept(kept, k, n))
                out.update({(f"{k}.{name}" if n > 1 else name): v for name, v in mine.items()})
        return out

    return retain


def load_back_of(stages: list[LayerStage], layer_writer: Any) -> Callable | None:
    """How a resumed streamed walk puts a finished layer back to compute the next layer's inputs: the written
    tensors (dequantized, decompressed), except for a stage whose next inputs are the layer *as read* (int8
    with SmoothQuant feeds the next layer the float layer's outputs): nothing to put back when it is alone,
    not resumable through a finished layer when other stages changed the layer too."""
    if any(s.resume_from_input for s in stages):
        return (lambda i, layer, tensors: None) if len(stages) == 1 else None
    return layer_writer.load_back


def finish_export(ctx: StageContext, tmp: Path, export: Export, result: dict, seconds: float,
                  head: Any = None) -> dict:
    """OUT's shards into place, config.json, the tokenizer; then the check of OUT, and OUT/model.gguf when a
    stage asks for it. `result`: the writing stage's result; `seconds`: the walk's; `head`: what a streamed run
    wrote for the modules outside the layers (`outside_head`). Returns report.json's `export`."""
    files = export.shards.finish(tmp)
    info = export.writer.write_config(tmp, result)
    ctx.tokenizer.save_pretrained(tmp)
    out = {**info, "dtype": str(ctx.out_dtype).removeprefix("torch."), **files, "seconds": round(seconds, 3),
           "device": str(ctx.device)}
    if export.probe is not None:
        out["verified"] = export.probe.check(tmp, head, ctx.state_dir, trust_remote_code=ctx.recipe.trust_remote_code,
                                             progress=ctx.progress, streamed=True if ctx.streamed else None,
                                             input_model=ctx.recipe.model, allow_nonfinite=ctx.recipe.allow_nonfinite)
    if getattr(export.writer, "gguf", False):
        out["gguf"] = _export_gguf(ctx, tmp)
    return out


def outside_head(stages: list) -> Any:
    """What a streamed run writes for a module outside the layers (the stages' `outside` hooks in order);
    its `names`: the modules some hook may change (the others are written as read)."""
    def module(name: str, read: Any) -> Any:
        for stage in stages:
            changed = stage.outside(name, read)
            if changed is not None:
                read = changed[0]
        return read
    module.names = set().union(*(stage.outside_names() for stage in stages))
    return module


def _gguf_stage(recipe: Any) -> Any:
    """The last stage that asks for `format: gguf` (None when none does)."""
    return next((s for s in reversed(recipe.stages) if getattr(s, "format", None) == "gguf"), None)


def check_gguf(ctx: StageContext) -> None:
    """Refuse before any work a model whose architecture GGUF cannot name, or whose tokenizer (when not copied
    from the input's GGUF file) llama.cpp would split differently (formats/gguf_export.py, gguf_vocab.py)."""
    if _gguf_stage(ctx.recipe) is not None and ctx.model is not None:
        from geminicompress.formats.gguf_export import gguf_arch
        from geminicompress.formats.gguf_vocab import tokenizer_pre

        gguf_arch(ctx.model.config.to_dict())
        if _source_gguf(ctx.source) is None:
            tokenizer_pre(ctx.tokenizer)


def _source_gguf(source: Any) -> Path | None:
    """The GGUF file the run's input was read from (`models.loading.ModelSource`; the demo's included), else None."""
    if source is None:
        return None
    if source.kind == "demo":
        return source.path
    if source.kind == "gguf" and source.path is not None and source.gguf_file:
        return source.path / source.gguf_file
    return None


def _export_gguf(ctx: StageContext, tmp: Path) -> dict:
    """OUT/model.gguf from OUT as written; the tokenizer copied from the input's GGUF file when it came from one."""
    from geminicompress.formats.gguf_export import GGUFOptions, export

    ctx.progress.info(f"writing {final_name(tmp)}/model.gguf")
    options = GGUFOptions(**_gguf_stage(ctx.recipe).gguf_options())
    written = export(tmp, options, source_gguf=_source_gguf(ctx.source))
    if written.get("tokenizer_warning"):
        ctx.progress.warn(written["tokenizer_warning"])
    return written
