"""Write a quantized model to disk: `export_quantized(model, tokenizer, out, qweights, fmt, meta)`.

`qweights` maps full module names ("model.layers.3.self_attn.q_proj") to their `QuantizedWeight`;
every other tensor of the model is written as it is (floats cast to `meta["dtype"]`). Formats:
- "gptq": GPTQ v1 (packing/gptq.py), plus `quantize_config.json`;
- "compressed-tensors": pack-quantized (packing/compressed_tensors.py);
- "dense": the dequantized float weights, for tools that know no quantized format;
- "awq": delegated to `packing/awq.py:export_awq` (written alongside the AWQ method).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from geminicompress import __version__
from geminicompress.compress.arch import arch_for, get_module
from geminicompress.compress.grid import QuantizedWeight, QuantSpec
from geminicompress.compress.packing import compressed_tensors as ct
from geminicompress.compress.packing import gptq
from geminicompress.errors import InputError

FORMATS = ("gptq", "compressed-tensors", "dense", "awq")


def scale_dtype(fmt: str, dtype: str) -> torch.dtype:
    """The dtype a format stores scales in; quantize with scales already rounded to it so that the
    in-memory model and the written checkpoint compute the same weights."""
    return torch.float16 if fmt in ("gptq", "awq") else getattr(torch, dtype)


def check_exportable(model: nn.Module, shapes: dict[str, tuple[int, int]], spec: QuantSpec, fmt: str) -> None:
    """Raise InputError before any work if `fmt` cannot hold these (out, in) shapes at `spec`."""
    if fmt not in FORMATS:
        raise InputError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    check = {"gptq": gptq.check_shape, "compressed-tensors": ct.check_shape}.get(fmt)
    if check is not None:
        for name, (out_f, in_f) in shapes.items():
            check(name, out_f, in_f, spec)


def single_spec(qweights: dict[str, QuantizedWeight]) -> QuantSpec:
    """The one quantization spec shared by every weight of an export (each format stores one)."""
    if not qweights:
        raise InputError("nothing was quantized: no module to export")
    specs = {qw.spec for qw in qweights.values()}
    if len(specs) != 1:
        raise InputError(f"one export holds one quantization spec, got {len(specs)}")
    return specs.pop()


def export_quantized(model: nn.Module, tokenizer: Any, out: Path, qweights: dict[str, QuantizedWeight],
                     fmt: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Write model + tokenizer to `out` in `fmt`; return a summary for report.json."""
    if fmt == "awq":
        export_awq = getattr(importlib.import_module("geminicompress.compress.packing.awq"), "export_awq")
        return export_awq(model, tokenizer, out, qweights, meta)
    spec = single_spec(qweights)
    check_exportable(model, {n: tuple(qw.q.shape) for n, qw in qweights.items()}, spec, fmt)
    dtype = getattr(torch, meta.get("dtype", "float32"))
    out = Path(out)
    if fmt == "dense":
        return _export_dense(model, tokenizer, out, qweights, dtype)

    tensors = _float_tensors(model, dtype, skip={f"{n}.weight" for n in qweights})
    with_g_idx = bool(meta.get("act_order")) and not meta.get("static_groups")
    for name, qw in qweights.items():
        packed = gptq.pack_gptq(qw) if fmt == "gptq" else ct.pack_ct(qw, scale_dtype(fmt, meta.get("dtype", "float32")), with_g_idx)
        tensors.update({f"{name}.{k}": v.cpu() for k, v in packed.items()})
    not_quantized = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in qweights]
    meta = {**meta, "version": __version__}
    if fmt == "gptq":
        layers = arch_for(model).layers + "."
        qconfig = gptq.gptq_config(spec, meta, [n for n in not_quantized if n.startswith(layers)])
    else:
        qconfig = ct.ct_config(spec, meta, not_quantized)

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(model, out, qconfig, dtype)
    if fmt == "gptq":
        quantize_config = {k: v for k, v in qconfig.items() if k not in ("meta", "dynamic")}
        (out / "quantize_config.json").write_text(json.dumps(quantize_config, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return {"format": fmt, "bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym,
            "quantized_modules": len(qweights), "float_modules": not_quantized,
            "size_bytes": (out / "model.safetensors").stat().st_size}


def _float_tensors(model: nn.Module, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
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


def _write_config(model: nn.Module, out: Path, qconfig: dict[str, Any], dtype: torch.dtype) -> None:
    model.config.save_pretrained(out)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = qconfig
    key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
    config[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _export_dense(model: nn.Module, tokenizer: Any, out: Path, qweights: dict[str, QuantizedWeight],
                  dtype: torch.dtype) -> dict[str, Any]:
    with torch.no_grad():
        for name, qw in qweights.items():
            weight = get_module(model, name).weight
            weight.copy_(qw.dequantize().to(weight.device, weight.dtype))
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"format": "dense", "dtype": str(dtype).removeprefix("torch."), "quantized_modules": len(qweights)}
