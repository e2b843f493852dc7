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

from geminicompress.core.errors import GeminiError
from geminicompress.formats.masks import MASKS_FILE

GGUF_BLOCKS_FILE = "gguf_blocks.safetensors"  # formats/gguf_blocks.py: a --gguf-type run's blocks, a side file

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# torch dtype <-> its name in a safetensors header
DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
               torch.bool: "BOOL"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


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
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name not in (MASKS_FILE, GGUF_BLOCKS_FILE)]
    if not files:
        raise GeminiError(f"{path} has no *.safetensors weights")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`, read into memory of its own (`read_file`)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        tensors.update(read_file(file))
    return tensors


def read_file(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors read with plain reads, each into its own memory, not mapped: a tensor of a
    mapped file keeps every page of the mapping it was read from resident until all its tensors go, so copying
    them out of it (the whole-checkpoint loader must: OUT's check) held the file twice for a moment (the demo's
    4-bit GPTQ: +0.2 GB at the run's peak). A dtype this reader does not know goes to safetensors' own loader."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        if any(info["dtype"] not in CODE_DTYPES for info in header.values()):
            return load_file(str(file))
        base, out = 8 + size, {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=CODE_DTYPES[info["dtype"]])
            f.seek(base + begin)
            if end > begin and f.readinto(tensor.view(-1).view(torch.uint8).numpy()) != end - begin:
                raise GeminiError(f"{file}: tensor {name} is cut short (the file ends before its last byte)")
            out[name] = tensor
        return out


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
