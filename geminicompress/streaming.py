"""Run a recipe on a model bigger than memory: decoder layers read from disk, processed and written to
output shards one at a time, so peak memory follows one layer, not the model.

The same engine as in memory (`layerwise.run_layerwise`), with a lazy layer *source*
(`models.lazy.LazyLayers`) and a shard-writing *sink* (`ShardSink` below, over `formats.shards`). The
layer-local stages of the recipe are composed into one `LayerFn`, so layer i gets every stage before
layer i+1 is read. Global magnitude pruning first finds its exact threshold in a streaming pass over the
checkpoint (`threshold.global_threshold` over `LazyTensors`), then prunes in the layer pass.

Streamed today: prune (magnitude, global or per layer, N:M), quantize int8/w8a8 without SmoothQuant, and
quantize gptq (calibrated: layer 0's inputs come from the embeddings, read alone; each layer's quantized
outputs feed the next), written as dense, compressed-tensors int-quantized or GPTQ v1 checkpoints. Float outputs keep the input's dtype
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
BASE_BYTES = 800 << 20  # the interpreter, torch, transformers, the skeleton and tokenizer (measured: ~0.7 GiB)


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
        elif stage.type == "quantize" and getattr(stage, "method", None) == "gptq":
            if stage.format not in ("gptq", "dense"):
                return f"stage {k}: gptq --format {stage.format} is not streamed yet (gptq and dense are)"
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


class _GPTQ:
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


# ---- estimates ----
def estimate(ckpt: LazyCheckpoint, out_dtype: torch.dtype, int8: bool, max_shard: int,
             windows: tuple[int, int] | None = None, gptq: Any = None) -> dict[str, int]:
    """Peak memory and disk of a streamed run, from the tensor shapes alone. Uncalibrated: one layer as
    stored plus a few float32 temporaries of its biggest tensor; calibrated (windows = (n, T), `gptq` the
    stage's options): the layer's weights (and a copy in the calibration dtype where that differs), the
    activations the one pass holds at the MLP's down projection (every window's layer input, residual,
    normed input and (n·T, intermediate) product), two buffers of the widest Hessian (the solver's) and
    three float32 copies of the biggest linear (the solver's weight, its codes, the dequantized result)."""
    n_layers = len(ckpt.layers)
    prefix = ckpt.layer_prefix(0) + "."
    biggest = max(i.numel for n, i in ckpt.tensors.items() if n.startswith(prefix))  # a decoder linear
    if windows is None:
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i)) for i in range(n_layers)) + 3 * 4 * biggest
        outside = max((2 * ckpt.nbytes(m) for m in ckpt.outside_modules()), default=0)  # read + written copy
        peak = BASE_BYTES + max(layer, outside)
    else:
        calib, held = gptq_dtypes(gptq, ckpt, out_dtype)
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i), held) for i in range(n_layers))
        if calib != held:
            layer += max(ckpt.nbytes(ckpt.layer_prefix(i), calib) for i in range(n_layers))
        widest = max(get_module(ckpt.model, n).in_features for n in
                     (f"{ckpt.layer_prefix(0)}.{lin}" for lin in ckpt.arch.linears))
        hidden = ckpt.model.config.hidden_size
        per_token = widest + 3 * hidden if gptq.one_pass else 3 * hidden  # --multi-pass: in and out, and a batch's
        activations = windows[0] * windows[1] * per_token * calib.itemsize
        peak = BASE_BYTES + layer + activations + 2 * 4 * widest**2 + 3 * 4 * biggest
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
                stages.append(_Prune(stage, ckpt, state, progress))
            elif stage.method == "gptq":
                stages.append(_GPTQ(stage, ckpt, out_dtype, progress))
            else:
                stages.append(_Int8(stage, ckpt))
        int8 = next((s for s in stages if isinstance(s, _Int8)), None)
        gptq = next((s for s in stages if isinstance(s, _GPTQ)), None)
        windows = _windows(recipe, path, gptq) if gptq is not None else None

        def tensors_of(i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if gptq is None:
                return module_tensors(ckpt.layer_prefix(i), layer, out_dtype)
            k = stages.index(gptq)
            mine = kept if len(stages) == 1 else {n[len(f"{k}."):]: v for n, v in kept.items() if n.startswith(f"{k}.")}
            return gptq.layer_tensors(i, layer, mine)

        t0 = time.perf_counter()
        calib_dtype = gptq.calib_dtype if gptq is not None else None
        # calibrated stages hold float32 master weights as in memory (unless bfloat16 ones are exact: _GPTQ);
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
            if isinstance(s, _Prune):
                result = s.summary(mine, tmp, progress)
            elif isinstance(s, _GPTQ):
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
        module = ckpt.materialise(name)
        mine = int8.quantize(module, name) if int8 is not None and name in int8.targets else []
        if mine:  # the module itself was a target: write its INT8 replacement
            module = mine[0]["module"]
        mine = [_public(r) for r in mine]
        writer.write(unit, module_tensors(name, module, dtype), {"rows": mine})
        rows += mine
        ckpt.release(name)
    return rows


def _windows(recipe: Recipe, path: Path, gptq: _GPTQ) -> torch.Tensor:
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

