"""What a model spec names, read without loading it: its stored float dtype and a short display name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from geminicompress.core.errors import GeminiError
from geminicompress.models.loading import resolve_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stored_dtype(spec: str) -> torch.dtype:
    """Load a checkpoint in the float dtype it was saved in (so a bf16 model is timed as bf16)."""
    try:
        source = resolve_model(spec)
    except GeminiError:
        return torch.float32
    if source.kind != "dir":
        return torch.float32
    try:
        config = json.loads((source.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return torch.float32
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.float32)


def display_names(specs: list[str]) -> list[str]:
    """Short unique names: the folder or file name, else the spec as typed."""
    names: list[str] = []
    for spec in specs:
        name = Path(spec.rstrip("/")).name or spec
        if name in names:
            name = spec
        names.append(name)
    return names
