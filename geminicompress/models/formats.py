"""Which loader reads which on-disk format: an explicit table, keyed by what `config.json` says.

A dense checkpoint has no `quantization_config` and loads with plain transformers. Every format this
project writes records itself in `config.json` -> `quantization_config`; `format_key` turns that into
a key of `LOADERS`. Loaders are named as "module:function" and imported only when needed, so a
format's code costs nothing until a model in that format is loaded.

A loader has the signature `load(path: Path, config: dict, dtype: torch.dtype) -> PreTrainedModel`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from geminicompress.errors import GeminiError, InputError

LOADERS: dict[str, str] = {
    "gptq": "geminicompress.compress.packing.gptq:load_gptq",
    "awq": "geminicompress.compress.packing.awq:load_awq",
    "compressed-tensors:int-quantized": "geminicompress.compress.int8.load:load_int_quantized",
    "compressed-tensors:pack-quantized": "geminicompress.compress.packing.compressed_tensors:load_pack_quantized",
    "compressed-tensors:sparse-bitmask": "geminicompress.compress.prune.load:load_sparse_bitmask",
    "compressed-tensors:sparse-24-bitmask": "geminicompress.compress.prune.load:load_sparse_bitmask",
}


def format_key(config: dict[str, Any]) -> str | None:
    """The `LOADERS` key for a model's config.json, or None for a dense checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt is None:
            groups = qc.get("config_groups") or {}
            fmts = {g.get("format") for g in groups.values() if isinstance(g, dict)}
            fmt = next(iter(fmts)) if len(fmts) == 1 else None
        if fmt is None and qc.get("sparsity_config"):
            fmt = qc["sparsity_config"].get("format")
        return f"compressed-tensors:{fmt}"
    return method


def loader_for(key: str, path: Path) -> Callable[..., Any]:
    target = LOADERS.get(key)
    if target is None:
        known = ", ".join(sorted(LOADERS))
        raise InputError(f"{path}: quantization format '{key}' is not one geminicompress reads (it reads: {known})")
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("geminicompress"):
            raise GeminiError(f"{path}: loading format '{key}' is not implemented in this version yet") from exc
        raise
    return getattr(module, func_name)
