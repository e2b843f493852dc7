"""Write an INT8 model in compressed-tensors layouts (what vLLM and llm-compressor read; docs/formats.md).

W8A8 (`--method w8a8`) is `int-quantized`; for every quantized linear `<name>`:
    <name>.weight        int8  (out, in)   codes in [-127, 127]
    <name>.weight_scale  float (out, 1)    one symmetric scale per output channel
(no zero points: symmetric). Everything else is stored as in a dense checkpoint; config.json's one config
group has 8-bit symmetric per-channel int weights and 8-bit symmetric per-token dynamic input activations.

Weight-only `int8` (W8A16) is `pack-quantized` 8-bit, as compressed-tensors and llm-compressor write
weight-only integers and as vLLM reads them (its config refuses `int-quantized` without input
activations unless the weights are floats): the same codes plus 128, four per int32 word
(`<name>.weight_packed`, formats/pack_quantized.py's layout), `<name>.weight_scale` and
`<name>.weight_shape`. Our loader reads it back as any pack-quantized file; `eval` runs it on the same
fbgemm W8A16 kernel as the int8 module (eval/engines/torch_kernels.py: 8-bit symmetric per-channel codes).

Loading int-quantized (ours, or llm-compressor's W8A8, or an older W8A16 of ours or theirs): build the
architecture without initialising weights, replace every linear whose stored `weight` is int8 (with a
`weight_scale`) by `W8A8Linear` (when the checkpoint declares input activations) or `Int8WeightOnlyLinear`,
then load the state dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.grid import QuantSpec
from geminicompress.core.errors import GeminiError
from geminicompress.formats import pack_quantized
from geminicompress.formats.bits import pack_bits
from geminicompress.formats.checkpoint import compressed_tensors_format, float_linears
from geminicompress.formats.reader import ModuleReader
from geminicompress.formats.writer import LayerWriter
from geminicompress.kernels.int8 import Int8WeightOnlyLinear, W8A8Linear
from geminicompress.kernels.shared_input import share_inputs

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


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for W8A8 (`int8` is written pack-quantized)."""
    group = {
        "targets": ["Linear"],
        "weights": _args("channel", dynamic=False),
        "input_activations": _args("token", dynamic=True),
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
    """INT8, one layer at a time: the layer's INT8 modules give their codes and scales (their state dicts),
    written as they are (w8a8: int-quantized) or packed (int8: pack-quantized 8-bit, `w8a16_packed`);
    `targets`: the linears made INT8 (the others are `ignore`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, method: str, targets: list[str],
                 int8_activations: bool) -> None:
        super().__init__(model, dtype)
        self.method, self.targets, self.int8_activations = method, set(targets), int8_activations
        self.format = KEY if int8_activations else pack_quantized.KEY

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.stored(super().layer_tensors(i, layer, kept))

    def outside_tensors(self, name: str, module: nn.Module) -> dict[str, torch.Tensor]:
        return self.stored(super().outside_tensors(name, module))

    def stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors if self.int8_activations else w8a16_packed(tensors)

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        ignore = float_linears(self.model, self.targets)
        if self.int8_activations:
            return quantization_config(ignore)
        return pack_quantized.ct_config(QuantSpec(8), {}, sorted(ignore))

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        return {**super().write_config(out, result), "method": self.method, "quantized_linears": len(self.targets)}


def w8a16_packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight-only INT8 tensors as compressed-tensors pack-quantized 8-bit: each `<m>.weight` of int8 codes
    c (with a `<m>.weight_scale`) becomes `<m>.weight_packed` (c + 128, four per int32 word, the first in
    the lowest bits) and `<m>.weight_shape`; the scales and every other tensor stay as they are."""
    stored: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and value.dtype == torch.int8 and f"{name}.weight_scale" in tensors:
            # c + 128 is c's byte with its top bit flipped: a byte a code, not int32 copies (4 GiB for a 262k head)
            stored[f"{name}.weight_packed"] = pack_bits(value.view(torch.uint8) ^ 128, 8).contiguous()
            stored[f"{name}.weight_shape"] = torch.tensor(list(value.shape), dtype=torch.int64)
        else:
            stored[key] = value
    return stored


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

    # q/k/v and gate/up as one GEMM each at run time (kernels/shared_input.py): same results
    return ModuleReader("weight_scale", ("weight", "weight_scale", "bias", *_OPTIONAL), build, after_load=share_inputs)


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
