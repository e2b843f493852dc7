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

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.int8.modules import Int8WeightOnlyLinear, W8A8Linear
from geminicompress.compress.int8.shared_input import share_inputs
from geminicompress.errors import GeminiError
from geminicompress.formats.checkpoint import compressed_tensors_format, float_linears
from geminicompress.formats.reader import ModuleReader, load_with_reader
from geminicompress.formats.writer import LayerWriter

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


class Int8Writer(LayerWriter):
    """compressed-tensors int-quantized, one layer at a time: the layer's INT8 modules write their codes and
    scales themselves (their state dicts); `targets`: the linears made INT8 (the others are `ignore`)."""

    format = KEY

    def __init__(self, model: nn.Module, dtype: torch.dtype, method: str, targets: list[str]) -> None:
        super().__init__(model, dtype)
        self.method, self.targets = method, set(targets)

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        return quantization_config(self.method, float_linears(self.model, self.targets))

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        return {**super().write_config(out, result), "method": self.method, "quantized_linears": len(self.targets)}


def reader(path: Path, config: dict[str, Any]) -> ModuleReader:
    """How an int-quantized linear is read: `W8A8Linear` when the checkpoint declares input activations,
    else `Int8WeightOnlyLinear`, holding the stored int8 codes and per-channel scales."""
    cls = W8A8Linear if _check_scheme(path, config["quantization_config"]) else Int8WeightOnlyLinear

    def build(name: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
        codes = parts.get("weight")
        if codes is None or codes.dtype != torch.int8 or codes.dim() != 2:
            raise GeminiError(f"{path}: {name}.weight_scale is stored but {name}.weight is not a 2-D int8 tensor")
        zero = parts.get("weight_zero_point")
        if zero is not None and zero.abs().max() > 0:
            raise GeminiError(f"{path}: {name}.weight_zero_point is non-zero (asymmetric weights); "
                              "geminicompress reads symmetric int8 only")
        module = cls(codes.shape[1], codes.shape[0], "bias" in parts, dtype)
        module.load_state_dict({k: v for k, v in parts.items() if k in ("weight", "weight_scale", "bias")})
        return module

    # q/k/v and gate/up as one GEMM each at run time (compress/int8/shared_input.py): same results
    return ModuleReader("weight_scale", ("weight", "weight_scale", "bias", *_OPTIONAL), build, after_load=share_inputs)


def load(path: Path, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The checkpoint with every int8 linear (`<name>.weight` int8 + `<name>.weight_scale`) an INT8 module."""
    return load_with_reader(path, dtype, reader(path, config))


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
