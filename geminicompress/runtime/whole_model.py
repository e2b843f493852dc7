"""The whole-model fallback (issue #36): what needs no structure runs on any model whose linears we can name.

Every layer-by-layer method walks decoder layers (engine/walk.py). When the trace finds none (no list of
repeated blocks holding linears: `core.trace.find_layers`), three methods still need nothing but the linear
weights and run here, on the whole model in memory:
- global magnitude pruning: one threshold over every targeted linear's |w| (`compress/prune/threshold.py`,
  the same k = round(sparsity · total) smallest, ties first come first);
- RTN b-bit: each weight rounded alone (`compress.rtn.quantize_linear`, scales rounded to the format's dtype);
- INT8 weight-only (`int8`), and `w8a8` without SmoothQuant: each linear swapped for its INT8 module.
This is the exception to "the decoder layer is the unit of work" (STYLE 14): there is no layer to be the
unit, so memory follows the model. One info line says so. Everything else refuses in one line (exit 2,
before loading), naming what is missing and what still works: a streamed run (nothing to read one layer at a
time), GPTQ/AWQ/Wanda/SparseGPT (each decoder layer's inputs; AWQ and SmoothQuant also the norm → linear
feeds they fold scales into), distillation.

OUT is written with the formats' public pieces (`pack_gptq`, `pack_ct`, the quantization configs, the sparse
bitmask's tensors), in the same formats the layer walk writes, and checked the same way: loaded back by our
loader and its logits compared with the in-process model's on the probe windows (`verify.compare`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors.torch import save_file

from geminicompress import __version__
from geminicompress.compress.int8.stage import select_linears
from geminicompress.compress.prune.threshold import global_threshold, prune_mask
from geminicompress.compress.rtn import quantize_linear
from geminicompress.core.config import ignore_to_check
from geminicompress.compress.targets import check_patterns_match, compile_patterns, resolve_group_size
from geminicompress.core.arch import get_module, tied_output
from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.core.trace import find_layers
from geminicompress.engine.verify import as_stored, compare, loaded_logits, model_logits, probe_windows, stored_dtype
from geminicompress.core.errors import InputError
from geminicompress.formats import check_shapes, gptq, int_quantized, pack_quantized, sparse_bitmask
from geminicompress.formats.checkpoint import WEIGHTS, float_linears, module_tensors, scale_dtype, write_config
from geminicompress.kernels.int8 import MODULES
from geminicompress.kernels.int8_quant import relative_error
from geminicompress.host.machine import machine, versions
from geminicompress.models.lazy import skeleton
from geminicompress.models.loading import LoadedModel, load_model, local_dir
from geminicompress.host.output import OutputDir, check_output_path, write_json
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.runtime.recipes.inputs import recipe_inputs
from geminicompress.runtime.recipes.loader import recipe_yaml
from geminicompress.runtime.recipes.schema import Recipe, stage_tag

WORKS = "global magnitude pruning, rtn and int8 (and w8a8 with --smoothquant-alpha 0) run on the whole model in memory"
# what a method needs that a model without decoder layers does not give
NEEDS = {
    "quantize:gptq": "each decoder layer's inputs (GPTQ's Hessians are gathered layer by layer)",
    "quantize:awq": "the norm -> linear feeds of a decoder layer to fold AWQ's scales into",
    "quantize:awq+gptq": "the norm -> linear feeds of a decoder layer to fold AWQ's scales into",
    "quantize:w8a8": "the norm -> linear feeds of a decoder layer to fold SmoothQuant's scales into",
    "prune:wanda": "each decoder layer's inputs (Wanda scores |w| by its input's norms)",
    "prune:sparsegpt": "each decoder layer's inputs (SparseGPT's Hessians are gathered layer by layer)",
    "distill": "decoder layers to build a student from",
}


def without_layers(recipe: Recipe, loaded: LoadedModel | None) -> bool:
    """Whether the recipe's MODEL has no decoder layers the trace can find (a local directory is judged from its
    config.json alone, no weight read); False when there is nothing to judge before loading (a hub id, a GGUF)."""
    if not any(s.type != "eval" for s in recipe.stages):
        return False
    if loaded is not None:
        model = loaded.model
    else:
        path = local_dir(recipe.model)
        if path is None or not (path / "config.json").is_file():
            return False
        model = skeleton(path, recipe.trust_remote_code)
    try:
        find_layers(model)
    except InputError:
        return True
    return False


def check_recipe(recipe: Recipe, stream: bool | None) -> Any:
    """The one stage the fallback runs; an InputError (before any work) for what it cannot."""
    stages = [s for s in recipe.stages if s.type != "eval"]
    model_type = _model_type(recipe)
    if stream:
        raise InputError(f"--stream: MODEL {recipe.model} ('{model_type}') has no decoder layers to read one at a time; "
                         f"run it without --stream: {WORKS}")
    for stage in stages:
        tag = "distill" if stage.type == "distill" else stage_tag(stage) if stage.type == "quantize" else \
            f"prune:{stage.method}"
        if tag in NEEDS and not (tag == "quantize:w8a8" and stage.smoothquant_alpha is None):
            raise InputError(f"{tag.replace(':', ' ')}: MODEL {recipe.model} ('{model_type}') has no decoder layers, and it "
                             f"needs {NEEDS[tag]}; {WORKS}")
    if len(stages) != 1 or len(recipe.stages) != 1:
        raise InputError(f"MODEL {recipe.model} ('{model_type}') has no decoder layers: the whole-model fallback runs "
                         "one compression stage and no eval stage; run `geminicompress eval` on OUT")
    stage = stages[0]
    if stage.type == "prune" and (stage.scope != "global" or stage.pattern or stage.format not in ("dense", "compressed-tensors")):
        raise InputError(f"prune: MODEL {recipe.model} ('{model_type}') has no decoder layers: only global magnitude "
                         "pruning runs on the whole model (no --scope layer, --pattern or --allocation)")
    if stage.type == "quantize" and stage.method == "rtn" and stage.format not in ("gptq", "compressed-tensors", "dense"):
        raise InputError(f"rtn: MODEL {recipe.model} ('{model_type}') has no decoder layers: the whole-model fallback "
                         f"writes gptq, compressed-tensors or dense, not {stage.format}")
    if stage.type == "quantize" and stage.method in ("int8", "w8a8") and stage.format != "compressed-tensors":
        raise InputError(f"{stage.method}: MODEL {recipe.model} ('{model_type}') has no decoder layers: the whole-model "
                         "fallback writes compressed-tensors only")
    return stage


def run_whole_model(recipe: Recipe, out: Path, *, force: bool = False, progress: Progress | None = None,
                    command: list[str] | None = None, loaded: LoadedModel | None = None, stream: bool | None = None,
                    verify: bool = True) -> dict:
    """The recipe's one stage on the whole model in memory, OUT written and checked; returns the report."""
    progress = progress or NullProgress()
    stage = check_recipe(recipe, stream)
    inputs = recipe_inputs(recipe)
    check_output_path(out, force, inputs)  # before the model loads
    started = time.perf_counter()
    if loaded is None:
        progress.info(f"loading {recipe.model}")
        loaded = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code, allow_pickle=recipe.allow_pickle,
                            allow_nonfinite=recipe.allow_nonfinite)
    model = loaded.model
    what = "magnitude pruning" if stage.type == "prune" else stage.method
    progress.info(f"'{_model_type(recipe, model)}': no decoder layers found; {what} runs on the whole model in memory")
    dtype = getattr(torch, recipe.output.dtype)
    with OutputDir(out, force, inputs=inputs) as tmp:
        t0 = time.perf_counter()
        if stage.type == "prune":
            written = _magnitude(model, stage, dtype)
        elif stage.method == "rtn":
            written = _rtn(model, stage, dtype, progress)
        else:
            written = _int8(model, stage, dtype)
        seconds = time.perf_counter() - t0
        windows = probe_windows(loaded.tokenizer, model.config.vocab_size)
        reference = None
        if verify:  # the in-process model as stored, before it is freed
            as_stored(model, dtype, written.exact)
            reference = model_logits(model, windows)
        tensors = written.tensors()
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        del tensors
        write_config(model, tmp, written.qconfig, dtype)
        if written.extra is not None:
            written.extra(tmp, written.qconfig)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp)
        export: dict[str, Any] = {"format": written.format, "whole_model": True, "dtype": recipe.output.dtype,
                                  "seconds": round(seconds, 3), "device": "cpu"}
        if reference is not None:
            progress.info("verifying: loading OUT back in memory")
            got = loaded_logits(tmp, windows, recipe.trust_remote_code, streamed=False)
            export["verified"] = compare(reference, got, stored_dtype(tmp), "in-memory")
        report = {"geminicompress": __version__, "command": command or [], "model": recipe.model, "output": str(out),
                  "total_seconds": round(time.perf_counter() - started, 3), "export": export,
                  "stages": [{"index": 0, "stage": stage_tag(stage), "options": stage.model_dump(mode="json"),
                              "seconds": round(seconds, 3), "result": written.summary}],
                  "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe, dtype))
    return report


class Written:
    """What OUT holds of a compressed model: its tensors (made when asked, the model's own otherwise), the
    format's quantization_config, the weights held as exact codes (left unrounded in the check)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, fmt: str, qconfig: dict[str, Any] | None,
                 summary: dict[str, Any], replace: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 exact: list[str] = (), extra: Callable[[Path, dict], None] | None = None) -> None:
        self.model, self.dtype, self.format, self.qconfig, self.summary = model, dtype, fmt, qconfig, summary
        self.replace, self.exact, self.extra = replace, list(exact), extra

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = module_tensors("", self.model, self.dtype)
        tied = _tied(self.model)
        if tied is not None:  # stored once, as save_pretrained does: the loader ties it again
            tensors.pop(f"{tied}.weight", None)
        return self.replace(tensors)


def _targets(model: nn.Module, ignore: list[str], check: list[str], what: str) -> list[str]:
    """The linears not matching `ignore` (nor the output head tied to the embeddings), in model order; each
    pattern in `check` must match a module."""
    patterns = compile_patterns(ignore)
    if check:
        check_patterns_match(compile_patterns(check), [n for n, _ in model.named_modules()], "module of the model")
    tied = _tied(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != tied
             and not any(p.search(n) for p in patterns)]
    if not names:
        raise InputError(f"the ignore patterns leave no linear layer to {what}")
    return names


@torch.no_grad()
def _magnitude(model: nn.Module, cfg: Any, dtype: torch.dtype) -> Written:
    """Global magnitude pruning of every targeted linear: exactly round(sparsity · total) weights zeroed."""
    names = _targets(model, cfg.ignore, ignore_to_check(cfg), "prune")
    weights = [get_module(model, n).weight for n in names]
    total = sum(w.numel() for w in weights)
    k = round(cfg.sparsity * total)
    th = global_threshold(weights, k, total=total)
    keep: dict[str, torch.Tensor] = {}
    rows = []
    for name, w, ties in zip(names, weights, th.ties):
        pruned = prune_mask(w, th.value, ties)
        w.masked_fill_(pruned, 0.0)
        keep[f"{name}.weight"] = pruned.logical_not_()  # in place: no second mask
        zeros = int((w == 0).sum())  # the rows prune's report has (compress/prune/report.py), one "layer"
        rows.append({"name": f"{name}.weight", "layer": "model", "linear": name, "shape": list(w.shape),
                     "params": w.numel(), "zeros": zeros, "sparsity": round(zeros / w.numel(), 6)})
    summary = {"method": "magnitude", "scope": "global", "pattern": None, "whole_model": True, "pruned_weights": k,
               "prunable_params": total, "achieved_sparsity": round(k / total, 6), "layers": rows}
    if cfg.format == "dense":
        return Written(model, dtype, "dense", None, summary, lambda t: t)
    ignore = [n for n in float_linears(model) if n not in names]

    def sparse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key, mask in keep.items():
            tensors.update(sparse_bitmask.weight_tensors(key, tensors.pop(key), mask, False))
        return tensors

    return Written(model, dtype, f"compressed-tensors:{sparse_bitmask.layout('unstructured')}",
                   sparse_bitmask.quantization_config("unstructured", k / total, ignore), summary, sparse)


@torch.no_grad()
def _rtn(model: nn.Module, cfg: Any, dtype: torch.dtype, progress: Progress) -> Written:
    """RTN of every targeted linear, packed in the recipe's format (gptq, compressed-tensors or dense)."""
    if getattr(cfg, "allocation", None) is not None:
        raise InputError("rtn: mixed precision (allocation) needs decoder layers; this model has none")
    names = _targets(model, cfg.ignore, ignore_to_check(cfg), "quantize")
    shapes = {n: tuple(get_module(model, n).weight.shape) for n in names}
    spec = QuantSpec(cfg.bits, resolve_group_size(cfg.group_size, shapes, progress), cfg.sym)
    check_shapes(cfg.format, shapes, spec)
    meta = {"dtype": str(dtype).removeprefix("torch."), "zero_point": not cfg.sym, "method": "rtn"}
    scales_as = scale_dtype(cfg.format, meta["dtype"])
    codes: dict[str, QuantizedWeight] = {}
    errors = []
    for name in names:
        qw, err = quantize_linear(get_module(model, name).weight, spec, scales_as)
        codes[name] = qw
        errors.append(err)
    summary = {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym, "format": cfg.format,
               "whole_model": True, "quantized_modules": len(names), "mean_weight_rel_error": sum(errors) / len(errors),
               "max_weight_rel_error": max(errors)}
    if cfg.format == "dense":
        return Written(model, dtype, "dense", None, summary, lambda t: t)
    not_quantized = float_linears(model, set(names))
    if cfg.format == "gptq":
        pack, fmt, extra = gptq.pack_gptq, gptq.KEY, gptq.write_quantize_config
        qconfig = gptq.quantization_config(spec, {n: spec for n in names}, meta, "", not_quantized)
    else:
        pack, fmt, extra = pack_quantized.packer(meta), pack_quantized.KEY, None
        qconfig = pack_quantized.ct_config(spec, meta, sorted(not_quantized))

    def packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, qw in codes.items():
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": v.cpu().contiguous() for k, v in pack(qw).items()})
        return tensors

    return Written(model, dtype, fmt, qconfig, summary, packed, exact=[f"{n}.weight" for n in names], extra=extra)


@torch.no_grad()
def _int8(model: nn.Module, cfg: Any, dtype: torch.dtype) -> Written:
    """Every targeted linear swapped for its INT8 module (int8: W8A16; w8a8 without SmoothQuant)."""
    names, kept = select_linears(model, cfg.ignore, ignore_to_check(cfg), _tied(model))
    if not names:
        raise InputError("the ignore patterns leave no linear layer to quantize")
    rows = []
    for name in names:
        linear = get_module(model, name)
        module = MODULES[cfg.method].from_linear(linear)
        err = relative_error(linear.weight, module.weight, module.weight_scale)
        parent, _, child = name.rpartition(".")
        setattr(get_module(model, parent) if parent else model, child, module)
        rows.append({"name": name, "shape": [module.out_features, module.in_features], "weight_rel_error": round(err, 6)})
    summary = {"method": cfg.method, "whole_model": True, "weights": "int8 symmetric per output channel",
               "activations": "int8 dynamic per token" if cfg.method == "w8a8" else "float (weight-only)",
               "quantized": len(rows), "kept_float": kept, "smoothquant": {"alpha": None}, "layers": rows}
    ignore = float_linears(model, set(names))
    if cfg.method == "w8a8":
        return Written(model, dtype, int_quantized.KEY, int_quantized.quantization_config(ignore), summary, lambda t: t)
    return Written(model, dtype, pack_quantized.KEY, pack_quantized.ct_config(QuantSpec(8), {}, sorted(ignore)),
                   summary, int_quantized.w8a16_packed)


def _tied(model: nn.Module) -> str | None:
    """The output head tied to the input embeddings (None also for a model that does not say which its
    embeddings are: transformers' `get_input_embeddings` raises NotImplementedError then)."""
    try:
        return tied_output(model)
    except NotImplementedError:
        return None


def _model_type(recipe: Recipe, model: nn.Module | None = None) -> str:
    if model is not None:
        return getattr(model.config, "model_type", "?")
    path = local_dir(recipe.model)
    try:
        return json.loads((path / "config.json").read_text()).get("model_type", "?") if path is not None else "?"
    except (OSError, ValueError):
        return "?"
