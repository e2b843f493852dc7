"""Load a compressed-tensors sparse-bitmask checkpoint (ours, or one in the same layout) as a dense model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from geminicompress.compress.prune.bitmask import SUFFIXES, decompress
from geminicompress.errors import GeminiError

MASKS_FILE = "prune_masks.safetensors"


def dense_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every `<module>.{compressed,bitmask,shape[,row_offsets]}` group by `<module>.weight`."""
    modules = {k.removesuffix(".bitmask") for k in tensors if k.endswith(".bitmask")}
    dense = {}
    for key, value in tensors.items():
        prefix, _, suffix = key.rpartition(".")
        if prefix in modules and suffix in SUFFIXES:
            continue
        dense[key] = value
    for module in modules:
        parts = {s: tensors[f"{module}.{s}"] for s in SUFFIXES if f"{module}.{s}" in tensors}
        dense[f"{module}.weight"] = decompress(parts)
    return dense


def load_sparse_bitmask(path: Path, config: dict[str, Any], dtype: torch.dtype):
    """`formats.LOADERS` entry for compressed-tensors:sparse-bitmask and :sparse-24-bitmask."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(path)
    if hasattr(conf, "quantization_config"):
        del conf.quantization_config
    model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        if file.name != MASKS_FILE:
            tensors.update(load_file(str(file)))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in dense_state_dict(tensors).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = set(missing) - _tied_names(model)
    if unexpected or untied:
        bad = sorted(untied) or sorted(unexpected)
        raise GeminiError(f"{path}: sparse-bitmask checkpoint does not match its config ({len(bad)} keys differ, e.g. {bad[0]})")
    model.tie_weights()
    return model


def _tied_names(model: Any) -> set[str]:
    """Names of the output embedding weight when it shares storage with the input embedding (stored once)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return set()
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight}
