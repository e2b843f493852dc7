"""Run a recipe on a model bigger than memory: decoder layers read from disk, processed and written to
output shards one at a time, so peak memory follows one layer, not the model.

The same engine as in memory (`layerwise.run_layerwise`), with a lazy layer *source*
(`models.lazy.LazyLayers`) and a shard-writing *sink* (`ShardSink` below, over `formats.shards`). The
layer-local stages of the recipe are composed into one `LayerFn`, so layer i gets every stage before
layer i+1 is read. Global magnitude pruning first finds its exact threshold in a streaming pass over the
checkpoint (`threshold.global_threshold` over `LazyTensors`), then prunes in the layer pass.

Streamed today: prune (magnitude, global or per layer, N:M) and quantize int8/w8a8 without SmoothQuant,
written as dense or compressed-tensors int-quantized checkpoints. Float outputs keep the input's dtype
unless the recipe's `output.dtype` is set. Modules outside the decoder layers (embeddings, final norm,
head) are read one at a time and written as they are (or quantized, for an int8 head not ignored).

Resume: the finished layers in the output shards are the resume state (`formats.shards`); a rerun of
the same command continues after the last finished one.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress import __version__
from geminicompress.compress.arch import get_module, set_module
from geminicompress.compress.layerwise import LayerFn, LayerJob, compose, run_layerwise
from geminicompress.errors import GeminiError, InputError
from geminicompress.formats.shards import DEFAULT_MAX_BYTES, ShardWriter
from geminicompress.machine import machine, versions
from geminicompress.models.lazy import (LazyCheckpoint, LazyLayers, LazyTensors, available_memory, free_disk,
                                        is_streamable_dir, weights_bytes)
from geminicompress.models.loading import resolve_model
from geminicompress.output import OutputDir, write_json
from geminicompress.progress import NullProgress, Progress
from geminicompress.recipes.loader import recipe_yaml
from geminicompress.recipes.schema import Recipe

AUTO_FRACTION = 0.5  # stream automatically when the float32 weights exceed this share of available memory
BASE_BYTES = 600 << 20  # the interpreter, torch and transformers themselves (measured: ~0.5 GiB)


# ---- deciding ----
def source_dir(recipe: Recipe) -> Path | None:
    """The local safetensors directory MODEL names (the demo's converted copy included), else None."""
    source = resolve_model(recipe.model)
    if source.kind == "demo":
        from geminicompress.models.loading import _demo_dir

        return _demo_dir()
    return source.path if source.kind == "dir" and is_streamable_dir(source.path) else None


def not_streamable(recipe: Recipe) -> str | None:
    """Why the recipe cannot be streamed, or None when it can."""
    if source_dir(recipe) is None:
        return f"MODEL {recipe.model} is not a local dense safetensors directory"
    for k, stage in enumerate(recipe.stages):
        if stage.type == "prune":
            if stage.method != "magnitude":
                return f"stage {k}: prune --method {stage.method} is not streamed yet (magnitude is)"
            if stage.scope == "global" and stage.pattern is None and k != 0:
                return f"stage {k}: global magnitude pruning streams only as the first stage"
            if stage.format != "dense":
                return f"stage {k}: prune --format {stage.format} is not streamed yet (dense is)"
        elif stage.type == "quantize" and getattr(stage, "method", None) in ("int8", "w8a8"):
            if stage.smoothquant_alpha is not None:
                return f"stage {k}: SmoothQuant calibration is not streamed yet"
        else:
            return f"stage {k}: {stage.type} {getattr(stage, 'method', '')} is not streamed yet".rstrip()
    if sum(s.type == "quantize" for s in recipe.stages) > 1:
        return "more than one quantize stage"
    return None


def should_stream(recipe: Recipe, stream: bool | None) -> bool:
    """--stream: yes (or a one-line error saying why it cannot); --no-stream: no; neither: when the
    recipe can stream and the model's float32 weights exceed AUTO_FRACTION of available memory."""
    if stream is False:
        return False
    reason = not_streamable(recipe)
    if stream and reason:
        raise InputError(f"--stream: {reason}")
    if reason:
        return False
    return bool(stream) or weights_bytes(source_dir(recipe)) > AUTO_FRACTION * available_memory()


# ---- the sink ----
class ShardSink:
    """Finished layers go into output shards as `tensors_of(i, layer)` and leave memory."""

    restores_weights = False

    def __init__(self, writer: ShardWriter, tensors_of: Callable[[int, nn.Module], dict[str, torch.Tensor]]) -> None:
        self.writer, self.tensors_of = writer, tensors_of

    def finished(self, i: int) -> bool:
        return self.writer.finished(f"layer.{i}")

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]:
        if layer is not None:
            raise GeminiError("resuming a calibrated streamed run is not supported yet; rerun with --force")
        return self.writer.summary(f"layer.{i}"), {}

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.writer.write(f"layer.{i}", self.tensors_of(i, layer), summary)
        return {}


def module_tensors(prefix: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A module's state dict under `prefix`, floating tensors in `dtype` (what save_pretrained writes)."""
    return {f"{prefix}.{k}": (v.to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in module.state_dict().items()}


# ---- the stages, per layer ----
class _Prune:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint, state_dir: Path, progress: Progress) -> None:
        from geminicompress.compress.prune.masks import parse_pattern
        from geminicompress.compress.prune.stage import _check_pattern, prunable_weights

        self.cfg, self.ckpt = cfg, ckpt
        self.targets = list(prunable_weights(ckpt.model, ckpt.arch, cfg.ignore, "ignore" in cfg.model_fields_set))
        self.pattern = parse_pattern(cfg.pattern)
        _check_pattern({n: get_module(ckpt.model, n.removesuffix(".weight")) for n in self.targets},
                       self.pattern, cfg.block_size)
        self.threshold: dict[str, Any] | None = None
        if cfg.scope == "global" and self.pattern is None:
            self.threshold = self._global_threshold(state_dir, progress)

    def _global_threshold(self, state_dir: Path, progress: Progress) -> dict[str, Any]:
        """The exact global |w| threshold, from a streaming pass over the checkpoint (cached for resuming)."""
        from geminicompress.compress.prune.threshold import global_threshold

        cache = state_dir / "threshold.json"
        if cache.is_file():
            return json.loads(cache.read_text())
        tensors = LazyTensors(self.ckpt, self.targets)
        k = round(self.cfg.sparsity * tensors.total)
        progress.info(f"global threshold: the {k:,}-th smallest |w| of {tensors.total:,}, streamed from disk")
        th = global_threshold(tensors, k, total=tensors.total)
        data = {"value": th.value, "ties": dict(zip(self.targets, th.ties)), "k": k}
        cache.write_text(json.dumps(data))
        return data

    def layer_fn(self) -> LayerFn:
        from geminicompress.compress.prune import report
        from geminicompress.compress.prune.masks import pattern_mask
        from geminicompress.compress.prune.threshold import prune_mask

        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            prefix = f"{job.arch.layers}.{job.index}"
            weights = {}
            for n in job.arch.linears:
                name = f"{prefix}.{n}.weight"
                if name not in self.targets:
                    continue
                W = job.module(n).weight
                if self.threshold is not None:
                    pruned = prune_mask(W, self.threshold["value"], self.threshold["ties"][name])
                else:
                    pruned = ~pattern_mask(W.detach().abs().float(), self.cfg.sparsity, self.pattern, per_row=False)
                W.masked_fill_(pruned, 0.0)
                weights[name] = W
            rows = report.layer_rows(weights, job.arch.layers)
            return {"sparsity": report.overall(rows), "rows": rows}, {}

        return process

    def summary(self, layer_summaries: list[dict], out_dir: Path, progress: Progress) -> dict[str, Any]:
        from geminicompress.compress.prune import report

        rows = [r for s in layer_summaries for r in s.get("rows", [])]
        achieved = report.overall(rows)
        cfg = self.cfg
        title = f"magnitude {cfg.pattern or cfg.scope}: {achieved:.2%} of {sum(r['params'] for r in rows):,} weights"
        report.write_histogram(rows, out_dir / "prune_sparsity.png", title)
        high = [r for r in rows if r["sparsity"] > report.HIGH]
        progress.info(f"pruned {achieved:.2%} of {len(rows)} linear layers' weights (magnitude, {cfg.pattern or cfg.scope})")
        value = self.threshold["value"] if self.threshold else None
        return {"method": "magnitude", "scope": cfg.scope, "pattern": cfg.pattern,
                "requested_sparsity": self.pattern[0] / self.pattern[1] if self.pattern else cfg.sparsity,
                "achieved_sparsity": round(achieved, 6), "prunable_params": sum(r["params"] for r in rows),
                "pruned_params": sum(r["zeros"] for r in rows),
                "threshold": value if value is not None and math.isfinite(value) else None,
                "layers_over_90pct": [r["name"] for r in high], "masks_file": None,
                "histogram_file": "prune_sparsity.png", "layers": rows, "streamed": True}


class _Int8:
    def __init__(self, cfg: Any, ckpt: LazyCheckpoint) -> None:
        from geminicompress.compress.int8.stage import select_linears

        self.cfg, self.ckpt = cfg, ckpt
        self.targets, self.kept = select_linears(ckpt.model, cfg.ignore, explicit="ignore" in cfg.model_fields_set)
        if ckpt.tied_output and ckpt.tied_output not in self.kept:  # the meta skeleton is not tied: say it
            self.kept[ckpt.tied_output] = "output head tied to the input embeddings"
            self.targets = [t for t in self.targets if t != ckpt.tied_output]
        if not self.targets:
            raise InputError("the ignore patterns leave no linear layer to quantize")

    def quantize(self, root: nn.Module, prefix: str) -> list[dict[str, Any]]:
        """Swap every targeted linear under module `root` (named `prefix` in the model) for its INT8 module."""
        from geminicompress.compress.int8.modules import MODULES
        from geminicompress.compress.int8.stage import _relative_error

        rows = []
        head = f"{prefix}." if prefix else ""
        for full in self.targets:
            if not (full == prefix or full.startswith(head)):
                continue
            rel = full[len(head):]
            linear = get_module(root, rel) if rel else root
            module = MODULES[self.cfg.method].from_linear(linear)
            err = _relative_error(linear.weight, module.dequantized_weight())
            if rel:
                set_module(root, rel, module)
            rows.append({"name": full, "shape": [module.out_features, module.in_features], "kernel": module.kernel,
                         "smoothquant_max_scale": None, "weight_rel_error": round(err, 6), "module": module})
        return rows

    def layer_fn(self) -> LayerFn:
        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            rows = self.quantize(job.layer, f"{job.arch.layers}.{job.index}")
            return {"quantized": len(rows), "int8_rows": [_public(r) for r in rows]}, {}

        return process

    def summary(self, layer_summaries: list[dict], outside_rows: list[dict]) -> dict[str, Any]:
        rows = [r for s in layer_summaries for r in s.get("int8_rows", [])] + outside_rows
        return {"method": self.cfg.method, "weights": "int8 symmetric per output channel",
                "activations": "int8 dynamic per token" if self.cfg.method == "w8a8" else "float (weight-only)",
                "quantized": len(rows), "kept_float": self.kept, "smoothquant": {"alpha": None}, "layers": rows,
                "streamed": True}


# ---- estimates ----
def estimate(ckpt: LazyCheckpoint, out_dtype: torch.dtype, int8: bool, max_shard: int) -> dict[str, int]:
    """Peak memory and disk of a streamed run, from the tensor shapes alone."""
    layer32 = max(ckpt.nbytes(ckpt.layer_prefix(i), torch.float32) for i in range(len(ckpt.layers)))
    outside32 = max((ckpt.nbytes(m, torch.float32) for m in ckpt.outside_modules()), default=0)
    biggest32 = max(i.numel * 4 for i in ckpt.tensors.values())
    unit = max(layer32, outside32)
    peak = BASE_BYTES + int(1.6 * unit) + 3 * biggest32  # layer in float32 + its output copy; one tensor's temporaries
    disk = 0
    for name, info in ckpt.tensors.items():
        if info.dtype.is_floating_point:
            disk += info.numel * (1 if int8 and name.endswith("proj.weight") else out_dtype.itemsize)
        else:
            disk += info.nbytes
    return {"peak_memory_bytes": peak, "disk_bytes": disk + min(max_shard, disk)}


# ---- the run ----
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
    need = estimate(ckpt, out_dtype, quant is not None, max_shard_bytes)
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
            stages.append(_Prune(stage, ckpt, state, progress) if stage.type == "prune" else _Int8(stage, ckpt))
        int8 = next((s for s in stages if isinstance(s, _Int8)), None)

        def tensors_of(i: int, layer: nn.Module) -> dict[str, torch.Tensor]:
            return module_tensors(ckpt.layer_prefix(i), layer, out_dtype)

        t0 = time.perf_counter()
        summaries, _ = run_layerwise(LazyLayers(ckpt, torch.float32), None, compose(*[s.layer_fn() for s in stages]),
                                     device=device, progress=progress, description="streamed layers",
                                     sink=ShardSink(writer, tensors_of))
        outside_rows = _write_outside(ckpt, writer, int8, out_dtype, progress)
        layers_s = time.perf_counter() - t0
        shards = writer.finish(tmp)
        qconfig = None
        if int8 is not None:
            from geminicompress.formats.int_quantized import quantization_config

            linears = [n for n, m in ckpt.model.named_modules() if isinstance(m, nn.Linear)]
            qconfig = quantization_config(int8.cfg.method, [n for n in linears if n not in int8.targets])
        write_config(ckpt.model, tmp, qconfig, out_dtype)
        _save_tokenizer(path, tmp, recipe.trust_remote_code)
        results = []
        for k, (stage, s) in enumerate(zip(recipe.stages, stages)):
            mine = [_unprefix(x, k, len(stages)) for x in summaries]
            result = s.summary(mine, tmp, progress) if isinstance(s, _Prune) else s.summary(mine, outside_rows)
            results.append({"index": k, "stage": _tag(stage), "options": stage.model_dump(mode="json"),
                            "seconds": round(layers_s, 3), "result": result})
        export = {"format": "compressed-tensors:int-quantized" if int8 else "dense",
                  "dtype": str(out_dtype).removeprefix("torch."), "streamed": True, **shards,
                  "estimated": need}
        report = {"geminicompress": __version__, "command": command or sys.argv, "model": recipe.model,
                  "output": str(out), "load_seconds": 0.0, "total_seconds": round(time.perf_counter() - started, 3),
                  "export": export, "stages": results, "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe))
    return report


def _write_outside(ckpt: LazyCheckpoint, writer: ShardWriter, int8: _Int8 | None, dtype: torch.dtype,
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
        module = ckpt.materialise(name, torch.float32)
        mine = int8.quantize(module, name) if int8 is not None and name in int8.targets else []
        if mine:  # the module itself was a target: write its INT8 replacement
            module = mine[0]["module"]
        mine = [_public(r) for r in mine]
        writer.write(unit, module_tensors(name, module, dtype), {"rows": mine})
        rows += mine
        ckpt.release(name)
    return rows


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "module"}


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

