"""The saved AWQ search, like llm-awq's `--dump_awq` / `--load_awq`: search once, export many times.

`OUT/awq_search/awq_search.safetensors` holds, per decoder layer i,
- `"{i}.smooth.{prev}"`: the scales s (in,) folded between `prev` and the linears it feeds;
- `"{i}.clip.{linear}"`: the clipping bounds (out, groups) of a linear's weight, after scaling;
and `awq_search.json` beside it what they were searched for (model type, layers, bits, group size, ...).
They live in a subfolder because checkpoint loaders read every `*.safetensors` at the top of OUT.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from geminicompress.core.errors import InputError

FOLDER = "awq_search"
TENSORS = "awq_search.safetensors"
META = "awq_search.json"
_KINDS = (".smooth.", ".clip.")


def search_tensors(kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The search results among the tensors run_layerwise kept ("<layer>.<name>")."""
    return {k: v for k, v in kept.items() if any(kind in k for kind in _KINDS)}


def save_search(out_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write the search into out_dir/awq_search/; return that folder."""
    out_dir = Path(out_dir) / FOLDER
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out_dir / TENSORS))
    (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def load_search(path: str | Path, model_type: str, num_layers: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a saved search (the file, its folder, or the awq run's OUT) and check that it fits this model."""
    path = Path(path).expanduser()
    if (path / FOLDER).is_dir():
        path = path / FOLDER
    if path.is_dir():
        path = path / TENSORS
    if not path.is_file():
        raise InputError(f"search results {path} do not exist (give an {TENSORS} written by an awq run)")
    meta_path = path.with_name(META)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and (meta.get("model_type") != model_type or meta.get("num_layers") != num_layers):
        raise InputError(
            f"search results {path} are for a {meta.get('model_type')} model with {meta.get('num_layers')} "
            f"layers, not this {model_type} model with {num_layers}"
        )
    return load_file(str(path)), meta


def layer_results(tensors: dict[str, torch.Tensor], index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(scales by prev name, clip bounds by linear name) of one layer."""
    smooth, clip = {}, {}
    for key, value in tensors.items():
        layer, _, rest = key.partition(".")
        if int(layer) != index:
            continue
        kind, _, name = rest.partition(".")
        (smooth if kind == "smooth" else clip)[name] = value
    return smooth, clip
