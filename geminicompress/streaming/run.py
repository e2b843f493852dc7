"""The streamed run: source (lazy layers) -> the stages' composed LayerFn -> sink (output shards), then the
modules outside the decoder layers, the config, the tokenizer and the report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress import __version__
from geminicompress.compress.layerwise import compose, run_layerwise
from geminicompress.errors import InputError
from geminicompress.formats.shards import DEFAULT_MAX_BYTES, ShardWriter
from geminicompress.machine import machine, versions
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers, free_disk
from geminicompress.output import OutputDir, write_json
from geminicompress.progress import NullProgress, Progress
from geminicompress.recipes.loader import recipe_yaml
from geminicompress.recipes.schema import Recipe
from geminicompress.streaming.decide import not_streamable, source_dir
from geminicompress.streaming.estimate import estimate
from geminicompress.streaming.gptq import StreamedGPTQ
from geminicompress.streaming.int8 import StreamedInt8, public_row
from geminicompress.streaming.prune import StreamedPrune
from geminicompress.streaming.sink import ShardSink, module_tensors


def run_streamed(recipe: Recipe, out: Path, *, force: bool = False, progress: Progress | None = None,
                 device: torch.device | None = None, command: list[str] | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Run `recipe` layer by layer from disk to OUT's shards; return the report (also OUT/report.json)."""
    from geminicompress.formats.checkpoint import write_config
    from geminicompress.pipeline import fingerprint

    progress = progress or NullProgress()
    device = device or torch.device("cpu")
    reason = not_streamable(recipe)
    if reason:
        raise InputError(f"cannot stream: {reason}")
    started = time.perf_counter()
    path = source_dir(recipe)
    ckpt = LazyCheckpoint(path, trust_remote_code=recipe.trust_remote_code)
    out_dtype = getattr(torch, recipe.output.dtype) if "dtype" in recipe.output.model_fields_set else ckpt.dtype
    quant = next((s for s in recipe.stages if s.type == "quantize"), None)
    calibrated = quant is not None and quant.method == "gptq"
    shape = (recipe.calibration.samples, recipe.calibration.seq_len) if calibrated else None
    need = estimate(ckpt, out_dtype, quant is not None, max_shard_bytes, shape, quant if calibrated else None)
    progress.info(f"streaming {len(ckpt.layers)} layers from {path}: estimated peak memory "
                  f"{need['peak_memory_bytes'] / 2**30:.2f} GiB, disk {need['disk_bytes'] / 2**30:.2f} GiB")
    parent = Path(out).resolve().parent
    if parent.is_dir() and free_disk(parent) < need["disk_bytes"]:
        raise InputError(f"not enough disk for {out}: needs ~{need['disk_bytes'] / 2**30:.2f} GiB, "
                         f"{free_disk(parent) / 2**30:.2f} GiB free")
    with OutputDir(out, force, fingerprint(recipe)) as tmp:
        state = tmp / "state" / "stream"
        state.mkdir(parents=True, exist_ok=True)
        writer = ShardWriter(state / "shards", max_shard_bytes)
        stages: list[Any] = []
        for stage in recipe.stages:
            if stage.type == "prune":
                stages.append(StreamedPrune(stage, ckpt, state, progress))
            elif stage.method == "gptq":
                stages.append(StreamedGPTQ(stage, ckpt, out_dtype, progress))
            else:
                stages.append(StreamedInt8(stage, ckpt))
        int8 = next((s for s in stages if isinstance(s, StreamedInt8)), None)
        gptq = next((s for s in stages if isinstance(s, StreamedGPTQ)), None)
        windows = _windows(recipe, path, gptq) if gptq is not None else None

        def tensors_of(i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if gptq is None:
                return module_tensors(ckpt.layer_prefix(i), layer, out_dtype)
            k = stages.index(gptq)
            mine = kept if len(stages) == 1 else {n[len(f"{k}."):]: v for n, v in kept.items() if n.startswith(f"{k}.")}
            return gptq.layer_tensors(i, layer, mine)

        t0 = time.perf_counter()
        calib_dtype = gptq.calib_dtype if gptq is not None else None
        # calibrated stages hold float32 master weights as in memory (unless bfloat16 ones are exact: StreamedGPTQ);
        # the others read layers as stored (half the memory for bf16) and compute in float32 per tensor
        compute = gptq.layer_dtype if gptq is not None else None
        summaries, _ = run_layerwise(LazyLayers(ckpt, compute), windows, compose(*[s.layer_fn() for s in stages]),
                                     device=device, progress=progress, description="streamed layers",
                                     calib_dtype=calib_dtype,
                                     sink=ShardSink(writer, tensors_of, gptq.load_back if gptq is not None else None))
        outside_rows = _write_outside(ckpt, writer, int8, out_dtype, progress)
        layers_s = time.perf_counter() - t0
        shards = writer.finish(tmp)
        qconfig = None
        if int8 is not None:
            from geminicompress.formats.int_quantized import quantization_config

            linears = [n for n, m in ckpt.model.named_modules() if isinstance(m, nn.Linear)]
            qconfig = quantization_config(int8.cfg.method, [n for n in linears if n not in int8.targets])
        if gptq is not None:
            gptq.write_config(tmp)
        else:
            write_config(ckpt.model, tmp, qconfig, out_dtype)
        _save_tokenizer(path, tmp, recipe.trust_remote_code)
        results = []
        for k, (stage, s) in enumerate(zip(recipe.stages, stages)):
            mine = [_unprefix(x, k, len(stages)) for x in summaries]
            if isinstance(s, StreamedPrune):
                result = s.summary(mine, tmp, progress)
            elif isinstance(s, StreamedGPTQ):
                result = s.summary(mine, windows)
            else:
                result = s.summary(mine, outside_rows)
            results.append({"index": k, "stage": _tag(stage), "options": stage.model_dump(mode="json"),
                            "seconds": round(layers_s, 3), "result": result})
        fmt = "compressed-tensors:int-quantized" if int8 else (gptq.cfg.format if gptq else "dense")
        export = {"format": fmt,
                  "dtype": str(out_dtype).removeprefix("torch."), "streamed": True, **shards,
                  "estimated": need}
        report = {"geminicompress": __version__, "command": command or sys.argv, "model": recipe.model,
                  "output": str(out), "load_seconds": 0.0, "total_seconds": round(time.perf_counter() - started, 3),
                  "export": export, "stages": results, "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe))
    return report


def _write_outside(ckpt: LazyCheckpoint, writer: ShardWriter, int8: StreamedInt8 | None, dtype: torch.dtype,
                   progress: Progress) -> list[dict]:
    """Embeddings, final norm, head: one module at a time (a tied head is not stored)."""
    rows: list[dict] = []
    for name in ckpt.outside_modules():
        unit = f"outside.{name}"
        if name == ckpt.tied_output:
            continue
        if writer.finished(unit):
            rows += writer.summary(unit).get("rows", [])
            continue
        module = ckpt.materialise(name)
        mine = int8.quantize(module, name) if int8 is not None and name in int8.targets else []
        if mine:  # the module itself was a target: write its INT8 replacement
            module = mine[0]["module"]
        mine = [public_row(r) for r in mine]
        writer.write(unit, module_tensors(name, module, dtype), {"rows": mine})
        rows += mine
        ckpt.release(name)
    return rows


def _windows(recipe: Recipe, path: Path, gptq: StreamedGPTQ) -> torch.Tensor:
    """The recipe's calibration windows (n, T), checked against GPTQ's need for tokens."""
    from geminicompress.data.windows import calibration_windows
    from geminicompress.models.loading import _load_tokenizer

    cal = recipe.calibration
    data = gptq.cfg.data or cal.data
    windows = calibration_windows(_load_tokenizer(str(path), recipe.trust_remote_code), data, cal.samples,
                                  cal.seq_len, recipe.seed, cal.text_column)
    widest = max(in_f for _, in_f in gptq.shapes.values())
    if windows.numel() < widest:
        raise InputError(f"GPTQ needs at least {widest} calibration tokens (the widest quantized layer's inputs), "
                         f"got {windows.numel()}; raise --samples or --calib-seq-len")
    return windows


def _unprefix(summary: dict, k: int, n: int) -> dict:
    if n == 1:
        return summary
    head = f"{k}."
    return {key[len(head):]: v for key, v in summary.items() if key.startswith(head)}


def _tag(stage: Any) -> str:
    from geminicompress.recipes.schema import stage_tag

    return stage_tag(stage)


def _save_tokenizer(src: Path, out: Path, trust: bool) -> None:
    from geminicompress.models.loading import _load_tokenizer

    _load_tokenizer(str(src), trust).save_pretrained(out)
