"""Checkpoint plumbing every format shares: the float tensors of a model, config.json with a
`quantization_config`, reading a folder's safetensors (single file or sharded), the float skeleton a
loader fills, and the one-spec rule of the quantized formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from geminicompress.compress.grid import QuantSpec
from geminicompress.errors import GeminiError, InputError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def scale_dtype(fmt: str, dtype: str) -> torch.dtype:
    """The dtype a format stores scales in; quantize with scales already rounded to it so that the
    in-memory model and the written checkpoint compute the same weights."""
    return torch.float16 if fmt in ("gptq", "awq") else getattr(torch, dtype)


def single_spec(qweights: Any) -> QuantSpec:
    """The one quantization spec shared by every weight of an export (each format stores one)."""
    if not qweights:
        raise InputError("nothing was quantized: no module to export")
    specs = {qw.spec for qw in qweights.values()}
    if len(specs) != 1:
        raise InputError(f"one export holds one quantization spec, got {len(specs)}")
    return specs.pop()


def float_tensors(model: nn.Module, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
    """The state dict minus `skip`, tied tensors once (transformers re-ties them), floats in dtype."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for key, value in model.state_dict().items():
        ident = (value.data_ptr(), tuple(value.shape))
        if key in skip or ident in seen:
            continue
        seen.add(ident)
        value = value.detach().cpu()
        tensors[key] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    return tensors


def float_linears(model: nn.Module, quantized: Any = ()) -> list[str]:
    """Names of the nn.Linear modules not in `quantized` (what the checkpoint keeps in float)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized]


def save_weights(tensors: dict[str, torch.Tensor], out: Path) -> int:
    """Write `tensors` as OUT/model.safetensors; return its size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    return (out / WEIGHTS).stat().st_size


def write_packed(model: nn.Module, tokenizer: Any, out: Path, qweights: Any, dtype: torch.dtype,
                 pack: Callable[[Any], dict[str, torch.Tensor]],
                 qconfig: Callable[[list[str]], dict[str, Any]]) -> tuple[int, list[str]]:
    """What every packed format does: float tensors in `dtype` except the quantized weights, each quantized
    module's `pack(qw)` tensors under its name, config.json with `qconfig(float linears)`, the tokenizer.
    Returns (bytes written, the float linears)."""
    tensors = float_tensors(model, dtype, skip={f"{n}.weight" for n in qweights})
    for name, qw in qweights.items():
        tensors.update({f"{name}.{k}": v.cpu() for k, v in pack(qw).items()})
    not_quantized = float_linears(model, qweights)
    size = save_weights(tensors, out)
    write_config(model, out, qconfig(not_quantized), dtype)
    tokenizer.save_pretrained(out)
    return size, not_quantized


def write_config(model: nn.Module, out: Path, qconfig: dict[str, Any] | None, dtype: torch.dtype | None) -> None:
    """config.json (+ generation_config.json) with `quantization_config` = qconfig and the float dtype."""
    model.config.save_pretrained(out)
    path = out / "config.json"
    config = json.loads(path.read_text())
    if qconfig is not None:
        config["quantization_config"] = qconfig
    if dtype is not None:
        key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
        config[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every *.safetensors but side files."""
    index = path / INDEX
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    from geminicompress.formats.masks import MASKS_FILE

    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != MASKS_FILE]
    if not files:
        raise GeminiError(f"{path} has no *.safetensors weights")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        tensors.update(load_file(str(file)))
    return tensors


def float_skeleton(path: Path, dtype: torch.dtype, init: bool = True) -> nn.Module:
    """The model's architecture from config.json, without its quantization_config, in `dtype`
    (weights left uninitialised with `init=False`: a loader overwrites them all)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if init:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tied_output_names(model: nn.Module) -> set[str]:
    """Names of the output embedding weight when it shares storage with the input embedding (stored once)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return set()
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight}


def quantized_summary(fmt: str, spec: QuantSpec, qweights: Any, float_modules: list[str], size: int) -> dict[str, Any]:
    return {"format": fmt, "bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym,
            "quantized_modules": len(qweights), "float_modules": float_modules, "size_bytes": size}


def compressed_tensors_format(qc: dict[str, Any]) -> str | None:
    """The compressed-tensors format a quantization_config names (top level, its one config group's, or
    its sparsity config's), or None when it is not compressed-tensors."""
    if str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return None
    fmt = qc.get("format")
    if fmt is None:
        fmts = {g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)}
        fmt = next(iter(fmts)) if len(fmts) == 1 else None
    if fmt is None and qc.get("sparsity_config"):
        fmt = qc["sparsity_config"].get("format")
    return fmt


def check_shapes(fmt: str, shapes: dict[str, tuple[int, int]], spec: QuantSpec) -> None:
    """Raise InputError before any work if quantized format `fmt` cannot hold these (out, in) shapes."""
    from geminicompress.formats import QUANTIZED, module

    if fmt not in QUANTIZED:
        raise InputError(f"format '{fmt}' is not one of {', '.join(QUANTIZED)}")
    for name, (out_f, in_f) in shapes.items():
        module(fmt).check_shape(name, out_f, in_f, spec)


def write_quantized(model: nn.Module, tokenizer: Any, out: Path, qweights: Any, fmt: str,
                    meta: dict[str, Any]) -> dict[str, Any]:
    """Write model + tokenizer to `out` in quantized format `fmt` (a `QUANTIZED` name)."""
    from geminicompress.formats import module

    if fmt in ("awq", "dense"):  # one spec per checkpoint (mixed precision: gptq and compressed-tensors)
        single_spec(qweights)
    for name in qweights:  # per module: a mixed-precision export checks each module at its own spec
        qw = qweights[name]
        check_shapes(fmt, {name: tuple(qw.q.shape)}, qw.spec)
    return module(fmt).write(model, tokenizer, Path(out), qweights, meta)

