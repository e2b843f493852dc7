"""Write an INT8 model in compressed-tensors' `int-quantized` layout (what vLLM and llm-compressor read).

On disk, for every quantized linear `<name>`:
    <name>.weight        int8  (out, in)   codes in [-127, 127]
    <name>.weight_scale  float (out, 1)    one symmetric scale per output channel
(no zero points: symmetric). Everything else is stored as in a dense checkpoint. `config.json` gains

    "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": [...float linears...],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {8-bit int, symmetric, channel},
                          "input_activations": {8-bit int, symmetric, token, dynamic} | null}}}

`input_activations` is null for weight-only `int8` (W8A16) and dynamic per-token for `w8a8`.

Loading (ours, or llm-compressor's W8A8/W8A16 int8): build the architecture without initialising
weights, replace every linear whose stored `weight` is int8 (with a `weight_scale`) by `W8A8Linear`
(when the checkpoint declares input activations) or `Int8WeightOnlyLinear`, then load the state dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress.compress.arch import set_module
from geminicompress.compress.int8.modules import Int8Base, Int8WeightOnlyLinear, W8A8Linear
from geminicompress.compress.int8.shared_input import share_inputs
from geminicompress.errors import GeminiError
from geminicompress.formats.checkpoint import compressed_tensors_format, float_linears, float_skeleton, read_tensors

FORMAT = "int-quantized"
KEY = f"compressed-tensors:{FORMAT}"
# Tensors other tools write that our modules do not need (static input scales, symmetric zero points).
_OPTIONAL = ("input_scale", "input_zero_point", "weight_zero_point", "output_scale", "output_zero_point")


def detect(qc: dict[str, Any]) -> bool:
    return compressed_tensors_format(qc) == FORMAT


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def quantization_config(method: str, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for `method` in ("int8", "w8a8")."""
    group = {
        "targets": ["Linear"],
        "weights": _args("channel", dynamic=False),
        "input_activations": _args("token", dynamic=True) if method == "w8a8" else None,
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def exporter(method: str, dtype: str) -> Callable[[Any, Any, Path], dict]:
    """An exporter `(model, tokenizer, out) -> info` for `ctx.exporter`; float tensors saved as `dtype`."""

    def export(model: nn.Module, tokenizer: Any, out: Path) -> dict:
        model = model.to(getattr(torch, dtype))  # float tensors only: int8 codes are untouched
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config(method, float_linears(model))
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return {"format": f"compressed-tensors:{FORMAT}", "method": method, "dtype": dtype,
                "quantized_linears": sum(isinstance(m, Int8Base) for m in model.modules())}

    return export


def load(path: Path, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    w8a8 = _check_scheme(path, config["quantization_config"])
    state = read_tensors(path)
    model = float_skeleton(path, dtype, init=False)  # we place the quantized modules ourselves
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
    share_inputs(model)  # q/k/v and gate/up as one GEMM each at run time (compress/int8/shared_input.py)
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


def _check_zero_points(path: Path, state: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        if key.endswith("weight_zero_point") and value.abs().max() > 0:
            raise GeminiError(f"{path}: {key} is non-zero (asymmetric weights); geminicompress reads symmetric int8 only")


def _is_tied_output(model: nn.Module, key: str) -> bool:
    out = model.get_output_embeddings()
    return bool(model.config.tie_word_embeddings) and out is not None and key.endswith("lm_head.weight")
