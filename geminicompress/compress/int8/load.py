"""Load a compressed-tensors `int-quantized` checkpoint (ours, or llm-compressor's W8A8/W8A16 int8)
into a model whose quantized linears are the fast modules of `modules.py`.

Build the architecture from config.json without initialising weights, replace every linear whose
stored `weight` is int8 (and has a `weight_scale`) by `W8A8Linear` (when the checkpoint declares
input activations) or `Int8WeightOnlyLinear` (weight-only), then load the state dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open

from geminicompress.compress.arch import set_module
from geminicompress.compress.int8.modules import Int8WeightOnlyLinear, W8A8Linear
from geminicompress.errors import GeminiError

# Tensors other tools write that our modules do not need (static input scales, symmetric zero points).
_OPTIONAL = ("input_scale", "input_zero_point", "weight_zero_point", "output_scale", "output_zero_point")


def load_int_quantized(path: Path, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    w8a8 = _check_scheme(path, config["quantization_config"])
    state = _read_state(path)
    hf_config = AutoConfig.from_pretrained(path)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # we place the quantized modules ourselves
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    cls = W8A8Linear if w8a8 else Int8WeightOnlyLinear
    for name, module in list(model.named_modules()):
        codes = state.get(f"{name}.weight")
        if isinstance(module, nn.Linear) and codes is not None and codes.dtype == torch.int8:
            if f"{name}.weight_scale" not in state:
                raise GeminiError(f"{path}: {name}.weight is int8 but {name}.weight_scale is missing")
            set_module(model, name, cls(module.in_features, module.out_features, module.bias is not None, dtype))
    _check_zero_points(path, state)
    state = {k: v for k, v in state.items() if not k.endswith(_OPTIONAL)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not _is_tied_output(model, k)]
    if really_missing or unexpected:
        what = really_missing[:1] or unexpected[:1]
        raise GeminiError(f"{path}: the int-quantized weights do not match the architecture (e.g. {what[0]})")
    model.tie_weights()
    return model.eval()


def _check_scheme(path: Path, qc: dict[str, Any]) -> bool:
    """Check we can run the checkpoint's scheme; return True when activations are quantized (W8A8)."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise GeminiError(f"{path}: int-quantized checkpoints with {len(groups)} config groups are not supported")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (8, "int", True, "channel"):
        raise GeminiError(f"{path}: weights are {w.get('num_bits')}-bit {w.get('type')} symmetric={w.get('symmetric')} "
                          f"strategy={w.get('strategy')}; geminicompress reads 8-bit symmetric per-channel int only")
    act = group.get("input_activations")
    if act and (act.get("num_bits"), act.get("type")) != (8, "int"):
        raise GeminiError(f"{path}: input activations are {act.get('num_bits')}-bit {act.get('type')}; expected 8-bit int")
    return bool(act)


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def _check_zero_points(path: Path, state: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        if key.endswith("weight_zero_point") and value.abs().max() > 0:
            raise GeminiError(f"{path}: {key} is non-zero (asymmetric weights); geminicompress reads symmetric int8 only")


def _is_tied_output(model: nn.Module, key: str) -> bool:
    out = model.get_output_embeddings()
    return bool(model.config.tie_word_embeddings) and out is not None and key.endswith("lm_head.weight")
