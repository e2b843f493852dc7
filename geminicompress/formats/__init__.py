"""On-disk formats: one module per format, one table that names them all (docs/extending.md).

Every format module has `KEY` (its name here: what config.json's `quantization_config` identifies),
`detect(qc) -> bool` (a test checks that `detect` below and the modules agree), `reader(path, config) ->
reader.ModuleReader` (how one of its quantized modules is read: `load` below, the whole checkpoint in memory,
and the layer-at-a-time reader, models/lazy.py, both build modules through it) and its per-layer `writer(...)`
(writer.py). The formats in `QUANTIZED` share `writer(model, dtype, specs, meta, qweights)`, a
`check_shape(name, out, in, spec)` that refuses what else they cannot hold, and `GROUPS`: a `Groups` when they
store whole groups (groups.py: the one check that a group divides a layer's inputs, which `check_shapes`
below runs), None when any group fits. Shared plumbing lives in `checkpoint.py`; nothing reaches into another format's private helpers.

A dense checkpoint has no `quantization_config` and loads with plain transformers. Modules are
imported only when a model in their format is read or written.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from geminicompress.core.grid import QuantSpec
from geminicompress.core.errors import InputError
from geminicompress.formats.checkpoint import compressed_tensors_format
from geminicompress.formats.groups import check_groups
from geminicompress.formats.reader import ModuleReader, load_with_reader

# KEY -> module. The order is the order `detect` asks in.
FORMATS: dict[str, str] = {
    "gptq": "geminicompress.formats.gptq",
    "awq": "geminicompress.formats.awq",
    "compressed-tensors:pack-quantized": "geminicompress.formats.pack_quantized",
    "compressed-tensors:int-quantized": "geminicompress.formats.int_quantized",
    "compressed-tensors:sparse-bitmask": "geminicompress.formats.sparse_bitmask",
    "compressed-tensors:sparse-24-bitmask": "geminicompress.formats.sparse_bitmask",
}

# The `format` a recipe names for quantized weights -> the module that writes it.
QUANTIZED: dict[str, str] = {
    "gptq": "geminicompress.formats.gptq",
    "awq": "geminicompress.formats.awq",
    "compressed-tensors": "geminicompress.formats.pack_quantized",
    "dense": "geminicompress.formats.dense",
    "gguf": "geminicompress.formats.gguf_export",  # a gptq checkpoint + OUT/model.gguf
}


def module(key: str) -> ModuleType:
    """The format module for a `FORMATS` key or a `QUANTIZED` recipe name."""
    target = FORMATS.get(key) or QUANTIZED.get(key)
    if target is None:
        raise InputError(f"format '{key}' is not one geminicompress knows (it knows: {', '.join(sorted({*FORMATS, *QUANTIZED}))})")
    return importlib.import_module(target)


def detect(config: dict[str, Any]) -> str | None:
    """The `FORMATS` key of a model's config.json, or None for a dense checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    fmt = compressed_tensors_format(qc)
    return f"compressed-tensors:{fmt}" if fmt is not None else str(qc.get("quant_method", "")).lower()


def _reader(path: Path, config: dict[str, Any]) -> ModuleReader:
    """The `ModuleReader` of the format config.json (`config`) names; InputError when geminicompress does not
    read it."""
    key = detect(config)
    if key not in FORMATS:
        raise InputError(f"{path}: quantization format '{key}' is not one geminicompress reads "
                         f"(it reads: {', '.join(FORMATS)})")
    return module(key).reader(Path(path), config)


def load(path: Path, config: dict[str, Any], dtype: Any) -> Any:
    """Load the checkpoint at `path` whose config.json is `config` (a format `detect` recognises): every
    module its format's reader recognises built by it, the rest loaded as stored (reader.load_with_reader)."""
    return load_with_reader(Path(path), dtype, _reader(path, config))


def module_reader(path: Path, config: dict[str, Any]) -> ModuleReader | None:
    """The `reader.ModuleReader` of the checkpoint at `path` (config.json = `config`), None when it is dense."""
    return None if detect(config) is None else _reader(path, config)


def check_shapes(fmt: str, shapes: dict[str, tuple[int, int]], spec: QuantSpec) -> None:
    """Raise InputError before any work if quantized format `fmt` cannot hold these (out, in) shapes: per linear,
    the format's own rules (`check_shape`), then whole groups (`check_groups`, where the format needs them)."""
    if fmt not in QUANTIZED:
        raise InputError(f"format '{fmt}' is not one of {', '.join(QUANTIZED)}")
    rules = module(fmt)
    for name, (out_f, in_f) in shapes.items():
        rules.check_shape(name, out_f, in_f, spec)
        check_groups(name, in_f, spec, rules.GROUPS)


def writer_for(fmt: str, model: Any, dtype: Any, specs: dict[str, Any], meta: dict[str, Any], qweights: Any) -> Any:
    """The per-layer writer (writer.py) of quantized format `fmt` (a `QUANTIZED` name) for the modules of
    `specs` ({full name: QuantSpec}), their codes given per layer by `qweights(i, kept)`."""
    return module(fmt).writer(model, dtype, specs, meta, qweights)
