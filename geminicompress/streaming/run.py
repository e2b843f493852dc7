"""The streamed run: source (lazy layers) -> the stages' composed LayerFn -> sink (output shards in the
format of the last stage that sets one), then the modules outside the decoder layers, the config, the
tokenizer and the report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from geminicompress import __version__
from geminicompress.engine.compose import compose
from geminicompress.engine.walk import run_layerwise
from geminicompress.errors import InputError
from geminicompress.formats.shards import DEFAULT_MAX_BYTES, ShardWriter
from geminicompress.machine import machine, versions
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers, free_disk
from geminicompress.models.loading import _load_tokenizer
from geminicompress.output import OutputDir, write_json
from geminicompress.progress import NullProgress, Progress
from geminicompress.recipes.loader import recipe_yaml
from geminicompress.recipes.schema import Recipe, stage_tag
from geminicompress.streaming.decide import calibration_data, not_streamable, source_dir
from geminicompress.streaming.estimate import estimate
from geminicompress.streaming.gptq import StreamedGPTQ
from geminicompress.streaming.int8 import StreamedInt8, public_row
from geminicompress.streaming.output import DenseOutput, Int8Output, LoadBack
from geminicompress.streaming.plan import calibration, make_stages
from geminicompress.streaming.sink import ShardSink, module_tensors
from geminicompress.streaming.stage import Done, StreamedStage, stage_kept
from geminicompress.streaming.verify import StreamedProbe, VerifyingSink, exact_weights, written_head


def run_streamed(recipe: Recipe, out: Path, *, force: bool = False, progress: Progress | None = None,
                 device: torch.device | None = None, command: list[str] | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_BYTES, verify: bool = True) -> dict:
    """Run `recipe` layer by layer from disk to OUT's shards; return the report (also OUT/report.json).
    verify: carry probe windows through the finished layers and compare OUT's logits with them (verify.py)."""
    from geminicompress.pipeline import fingerprint

    progress = progress or NullProgress()
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reason = not_streamable(recipe)
    if reason:
        raise InputError(f"cannot stream: {reason}")
    started = time.perf_counter()
    path = source_dir(recipe)
    ckpt = LazyCheckpoint(path, trust_remote_code=recipe.trust_remote_code)
    out_dtype = getattr(torch, recipe.output.dtype) if "dtype" in recipe.output.model_fields_set else ckpt.dtype
    calib = calibration(recipe.stages, ckpt, out_dtype, (recipe.calibration.samples, recipe.calibration.seq_len))
    need = estimate(ckpt, out_dtype, any(s.type == "quantize" for s in recipe.stages), max_shard_bytes, calib)
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
        stages = make_stages(recipe.stages, ckpt, out_dtype, state, progress, calib)
        outputs = [s.output() for s in stages]  # the format: the last stage's that sets one (as in memory)
        owner = max((k for k, o in enumerate(outputs) if o is not None), default=None)
        output = outputs[owner] if owner is not None else DenseOutput(ckpt, out_dtype)
        windows = _windows(recipe, path, stages) if calib is not None else None
        n = len(stages)

        def tensors_of(i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            for k, s in enumerate(stages):
                if hasattr(s, "finish_layer"):
                    s.finish_layer(i, stage_kept(kept, k, n))
            return output.layer_tensors(i, layer, stage_kept(kept, owner, n) if owner is not None else {})

        t0 = time.perf_counter()
        # calibrated stages hold float32 master weights as in memory (unless bfloat16 ones are exact: plan.py);
        # the others read layers as stored (half the memory for bf16) and compute in float32 per tensor
        source = LazyLayers(ckpt, calib.layer_dtype if calib is not None else None)
        tokenizer = _load_tokenizer(str(path), recipe.trust_remote_code)
        probe = StreamedProbe(ckpt, tokenizer, out_dtype, device) if verify else None  # before any layer is read
        sink = (VerifyingSink(writer, tensors_of, _load_back(stages, output), probe, exact_weights(output, owner, n))
                if probe is not None else ShardSink(writer, tensors_of, _load_back(stages, output)))
        summaries, _ = run_layerwise(source, windows, compose(*[s.layer_fn() for s in stages]), device=device,
                                     progress=progress, description="streamed layers",
                                     calib_dtype=calib.calib_dtype if calib is not None else None, sink=sink)
        int8 = next((s for s in stages if isinstance(s, StreamedInt8)), None)
        outside_rows = _write_outside(ckpt, writer, int8, out_dtype, progress)
        layers_s = time.perf_counter() - t0
        shards = writer.finish(tmp)
        done = Done(tmp, progress, windows=windows, outside_rows=outside_rows, calibration_data=recipe.calibration.data)
        results = []
        for k, (stage, s) in enumerate(zip(recipe.stages, stages)):
            result = s.summary([stage_kept(x, k, n) for x in summaries], done)
            results.append({"index": k, "stage": stage_tag(stage), "options": stage.model_dump(mode="json"),
                            "seconds": round(layers_s, 3), "result": result})
        output.write_config(tmp, results[owner]["result"] if owner is not None else {})
        _save_tokenizer(path, tmp, recipe.trust_remote_code)
        export = {"format": output.format, "dtype": str(out_dtype).removeprefix("torch."), "streamed": True,
                  **shards, "estimated": need, "device": str(device)}
        if device.type == "cuda":
            export["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if probe is not None:
            export["verified"] = probe.check(tmp, written_head(int8), state, trust_remote_code=recipe.trust_remote_code,
                                             progress=progress)
        report = {"geminicompress": __version__, "command": command or sys.argv, "model": recipe.model,
                  "output": str(out), "load_seconds": 0.0, "total_seconds": round(time.perf_counter() - started, 3),
                  "export": export, "stages": results, "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe))
    return report


def _load_back(stages: list[StreamedStage], output: DenseOutput) -> LoadBack | None:
    """How a resumed calibrated run puts a finished layer back to compute the next layer's inputs: the
    written tensors (dequantized, decompressed). SmoothQuant alone feeds the next layer the *float* layer's
    outputs: the layer as read from the input. INT8 modules after other calibrated stages: not resumable."""
    if isinstance(output, Int8Output):
        return (lambda i, layer, tensors: None) if len(stages) == 1 else None
    return output.load_back


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


def _windows(recipe: Recipe, path: Path, stages: list[StreamedStage]) -> torch.Tensor:
    """The calibration windows (n, T) of the recipe's calibrated stages, checked against GPTQ's need for tokens."""
    from geminicompress.data.windows import calibration_windows

    cal = recipe.calibration
    windows = calibration_windows(_load_tokenizer(str(path), recipe.trust_remote_code), calibration_data(recipe),
                                  cal.samples, cal.seq_len, recipe.seed, cal.text_column)
    for s in stages:
        if isinstance(s, StreamedGPTQ):
            widest = max(in_f for _, in_f in s.shapes.values())
            if windows.numel() < widest:
                raise InputError(f"GPTQ needs at least {widest} calibration tokens (the widest quantized layer's "
                                 f"inputs), got {windows.numel()}; raise --samples or --calib-seq-len")
    return windows


def _save_tokenizer(src: Path, out: Path, trust: bool) -> None:
    _load_tokenizer(str(src), trust).save_pretrained(out)
