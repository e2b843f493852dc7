"""compressed-tensors `pack-quantized` (what llm-compressor writes and vLLM reads).

Per quantized linear (out, in) with G groups and b bits:
- `weight_packed` int32 (out, ⌈in·b/32⌉): codes along the input, bits.py stream layout (the signed
  compressed-tensors value plus 2^(b−1), i.e. exactly our unsigned code);
- `weight_scale` (out, G) in the checkpoint's float dtype;
- `weight_zero_point` int32 (⌈out·b/32⌉, G), asymmetric only: unsigned zero points packed along the
  output dimension (compressed-tensors stores them signed, minus 2^(b−1), before the same offset);
- `weight_shape` int64 [out, in];
- `weight_g_idx` int32 (in,) only with act-order groups (`actorder: group`).
Strategy `channel` for per-channel, `group` otherwise; linears not quantized are listed in `ignore`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress.core.grid import QuantizedWeight, QuantSpec, group_index
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats.bits import pack_bits, unpack_bits
from geminicompress.formats.checkpoint import compressed_tensors_format, scale_dtype
from geminicompress.formats.dequant import dequant_reader
from geminicompress.formats.groups import Groups
from geminicompress.formats.mixed import ct_config_groups, ct_spec_of
from geminicompress.formats.reader import ModuleReader
from geminicompress.formats.writer import PackedLayout, PackedWriter, QWeights

KEY = "compressed-tensors:pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
GROUPS = Groups()  # whole groups, or one per output channel (formats/groups.py)
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the layout of that release (dense bit streams for 3-bit)


def detect(qc: dict[str, Any]) -> bool:
    return compressed_tensors_format(qc) == "pack-quantized"


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Its kernels' bit widths (and whole groups: `GROUPS`)."""
    if spec.bits == 5:
        raise InputError("compressed-tensors' kernels hold 2, 3, 4 or 8-bit codes, not 5: use --format gguf (Q5_0) "
                         "or dense")


def pack_ct(qw: QuantizedWeight, scale_dtype: torch.dtype, with_g_idx: bool) -> dict[str, torch.Tensor]:
    out_f, in_f = qw.q.shape
    tensors = {
        "weight_packed": pack_bits(qw.q, qw.spec.bits).contiguous(),  # (out, ⌈in·b/32⌉)
        "weight_scale": qw.scales.to(scale_dtype).contiguous(),  # (out, G)
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    if not qw.spec.sym:
        tensors["weight_zero_point"] = pack_bits(qw.zeros.t(), qw.spec.bits).t().contiguous()  # (⌈out·b/32⌉, G)
    if with_g_idx:
        tensors["weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
    return tensors


def unpack_ct(tensors: dict[str, torch.Tensor], spec: QuantSpec, codes: torch.dtype = torch.int32) -> QuantizedWeight:
    """The QuantizedWeight of one module's tensors, its codes as `codes` (uint8: what DequantLinear keeps)."""
    out_f, in_f = (int(v) for v in tensors["weight_shape"].tolist())
    scales = tensors["weight_scale"].float()  # (out, G)
    q = unpack_bits(tensors["weight_packed"], spec.bits, in_f, codes)
    if spec.sym:
        zeros = torch.full(scales.shape, (spec.maxq + 1) // 2, dtype=torch.int32)
    else:
        zeros = unpack_bits(tensors["weight_zero_point"].t(), spec.bits, out_f).t().contiguous()
    g_idx = tensors.get("weight_g_idx")
    g_idx = group_index(in_f, spec) if g_idx is None else g_idx.to(torch.int32)
    return QuantizedWeight(q, scales.contiguous(), zeros, g_idx, spec)


def ct_config(spec: QuantSpec, meta: dict[str, Any], ignore: list[str],
              specs: dict[str, QuantSpec] | None = None) -> dict[str, Any]:
    """`quantization_config` for weight-only INT-b `pack-quantized` (W4A16 and alike); with `specs` of
    several kinds (mixed precision), one config group per spec (formats/mixed.py)."""
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights(spec, meta), "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
    if specs is not None and len(set(specs.values())) > 1:
        config["config_groups"] = ct_config_groups(specs, lambda s: _weights(s, meta))
    return config


def _weights(spec: QuantSpec, meta: dict[str, Any]) -> dict[str, Any]:
    """A config group's `weights` entry for `spec` (`meta["act_order"]` gives its actorder)."""
    actorder = {"static": "weight", "group": "group"}.get(meta.get("act_order"))  # "weight": no g_idx in the file
    return {
        "num_bits": spec.bits,
        "type": "int",
        "symmetric": spec.sym,
        "strategy": "channel" if spec.group_size == -1 else "group",
        "group_size": None if spec.group_size == -1 else spec.group_size,
        "actorder": actorder,
        "block_structure": None,
        "dynamic": False,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def packer(meta: dict[str, Any]) -> Callable[[QuantizedWeight], dict[str, torch.Tensor]]:
    """`pack_ct` for an export with `meta`: scales in meta["dtype"], g_idx only with act-order groups."""
    with_g_idx = meta.get("act_order") == "group"
    scales_as = scale_dtype("compressed-tensors", meta.get("dtype", "float32"))
    return lambda qw: pack_ct(qw, scales_as, with_g_idx)


def writer(model: nn.Module, dtype: torch.dtype, specs: dict[str, QuantSpec], meta: dict[str, Any],
           qweights: QWeights) -> PackedWriter:
    """The per-layer writer of pack-quantized; mixed precision as one config group per spec."""
    return PackedWriter(model, dtype, specs, qweights, PackedLayout(
        KEY, packer(meta), unpack_ct, SUFFIXES,
        lambda spec, all_specs, ignore: ct_config(spec, meta, ignore, all_specs)))


def reader(path: Path, config: dict) -> ModuleReader:
    """How a pack-quantized linear is read: a `DequantLinear` at the spec of its config group."""
    qc = config["quantization_config"]
    groups = qc.get("config_groups") or {}
    if not any(g.get("weights") for g in groups.values()):
        raise GeminiError(f"{path}: no weight-quantization config group")

    def unpack_module(name: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        try:
            spec = ct_spec_of(groups, name)
        except GeminiError as exc:
            raise GeminiError(f"{path}: {exc}") from exc
        if spec is None:
            raise GeminiError(f"{path}: quantized module {name} matches no config group")
        return unpack_ct(tensors, spec, torch.uint8)  # DequantLinear keeps its codes as uint8 (bits <= 8)

    return dequant_reader(SUFFIXES, unpack_module)
