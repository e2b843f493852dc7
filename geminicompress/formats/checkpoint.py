"""Checkpoint plumbing every format shares: a module's tensors as written, config.json with a
`quantization_config`, reading a folder's safetensors (single file or sharded), the float skeleton a
loader fills (the per-layer writer every format's writer builds on is writer.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file

from geminicompress.errors import GeminiError
from geminicompress.formats.masks import MASKS_FILE

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def scale_dtype(fmt: str, dtype: str) -> torch.dtype:
    """The dtype a format stores scales in; quantize with scales already rounded to it so that the
    in-memory model and the written checkpoint compute the same weights."""
    return torch.float16 if fmt in ("gptq", "awq", "gguf") else getattr(torch, dtype)


def module_tensors(prefix: str, module: nn.Module, dtype: torch.dtype,
                   skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """A module's state dict under `prefix`, floating tensors in `dtype` (what save_pretrained writes);
    `skip`: names (relative to the module) the caller writes another way (packed linears' weights)."""
    head = f"{prefix}." if prefix else ""
    return {f"{head}{k}": (v.to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in module.state_dict().items() if k not in skip}


def float_linears(model: nn.Module, quantized: Any = ()) -> list[str]:
    """Names of the nn.Linear modules not in `quantized` (what the checkpoint keeps in float)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized]


def write_config(model: nn.Module, out: Path, qconfig: dict[str, Any] | None, dtype: torch.dtype | None) -> None:
    """config.json (+ generation_config.json) with `quantization_config` = qconfig and the float dtype; the
    architecture's class is named (`architectures`, which vLLM needs) when the config does not say it."""
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
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


def float_skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model's architecture from config.json, without its quantization_config, in `dtype`, its parameters
    on the meta device (no memory: the loader assigns every one of them, or swaps its module for a quantized
    one); buffers (rotary inv_freq) real and computed as transformers computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


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
