"""The prune stage's keep-masks, saved beside a pruned checkpoint as `prune_masks.safetensors`
({parameter name: bool keep-mask of the parameter's shape}). Not weights: loaders skip the file, and
size reports count it apart. A following distill stage (sparse recovery) reads it back."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MASKS_FILE = "prune_masks.safetensors"


def read_masks(folder: Path) -> dict[str, torch.Tensor] | None:
    """The masks saved next to a model (bool tensors), or None when there are none."""
    path = Path(folder) / MASKS_FILE
    return {k: v.bool() for k, v in load_file(path).items()} if path.is_file() else None


def write_masks(masks: dict[str, torch.Tensor], folder: Path) -> None:
    save_file({k: v.bool().cpu().contiguous() for k, v in masks.items()}, str(Path(folder) / MASKS_FILE))
