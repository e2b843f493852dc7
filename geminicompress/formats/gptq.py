"""The GPTQ v1 checkpoint format (AutoGPTQ's, read by transformers+GPTQModel and vLLM).

Per quantized linear with `in` inputs, `out` outputs, `G` groups and b bits:
- `qweight` int32 (in·b/32, out): codes packed along the input dimension (bits.py stream layout);
- `qzeros`  int32 (G, out·b/32): zero points minus one (the v1 convention) packed along the output;
- `scales`  fp16 (G, out);
- `g_idx`   int32 (in,): the group of each input column (j // group_size unless act-order permuted);
- `bias`    as the model has it.
`config.json` -> `quantization_config` (and `quantize_config.json`) carry bits, group_size,
desc_act, sym and checkpoint_format "gptq". A symmetric zero point is 2^(b−1) and stored as 2^(b−1)−1.
An asymmetric zero point of 0 is stored as −1 ≡ 2^b−1 (masked): we read it back exactly, but
GPTQModel's v1->v2 conversion adds 1 to the whole word and carries into the neighbour field.
"""

from __future__ import annotations

import json
from math import gcd
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress import __version__
from geminicompress.core.arch import arch_for
from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats.bits import pack_bits, unpack_bits
from geminicompress.formats.dequant import dequant_reader
from geminicompress.formats.groups import Groups
from geminicompress.formats.mixed import dynamic_spec, gptq_dynamic
from geminicompress.formats.reader import ModuleReader
from geminicompress.formats.writer import PackedLayout, PackedWriter, QWeights

KEY = "gptq"
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
GROUPS = Groups()  # whole groups, or one per output channel (formats/groups.py)


def detect(qc: dict[str, Any]) -> bool:
    return str(qc.get("quant_method", "")).lower() == "gptq"


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """The format needs whole words along both dimensions (and whole groups: `GROUPS`)."""
    if spec.bits == 5:
        raise InputError("the gptq format's kernels hold 2, 3, 4 or 8-bit codes, not 5: use --format gguf (Q5_0) or dense")
    if (in_f * spec.bits) % 32 or (out_f * spec.bits) % 32:
        raise InputError(f"{name}: gptq format packs {spec.bits}-bit codes into 32-bit words, which needs "
                         f"in/out features ({in_f}/{out_f}) to be multiples of {32 // gcd(spec.bits, 32)}; "
                         "use --format compressed-tensors or dense, or --ignore this module")


def pack_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    bits, maxq = qw.spec.bits, qw.spec.maxq
    return {
        "qweight": pack_bits(qw.q, bits).t().contiguous(),  # (out, in) -> (out, in·b/32) -> (in·b/32, out)
        "qzeros": pack_bits(((qw.zeros - 1) & maxq).t(), bits).contiguous(),  # (G, out·b/32), v1: zero − 1
        "scales": qw.scales.t().to(torch.float16).contiguous(),  # (G, out)
        "g_idx": qw.g_idx.to(torch.int32).cpu().contiguous(),  # (in,)
    }


def unpack_gptq(tensors: dict[str, torch.Tensor], spec: QuantSpec, v1: bool = True,
                codes: torch.dtype = torch.int32) -> QuantizedWeight:
    """The QuantizedWeight of one module's tensors, its codes as `codes` (uint8: what DequantLinear keeps)."""
    bits, maxq = spec.bits, spec.maxq
    g_idx = tensors["g_idx"].to(torch.int32)
    in_f, out_f = g_idx.numel(), tensors["scales"].shape[1]
    q = unpack_bits(tensors["qweight"].t(), bits, in_f, codes)  # (out, in)
    zeros = unpack_bits(tensors["qzeros"], bits, out_f).t()  # (out, G)
    if v1:
        zeros = (zeros + 1) & maxq
    return QuantizedWeight(q.contiguous(), tensors["scales"].t().float().contiguous(), zeros.contiguous(), g_idx, spec)


def quantization_config(spec: QuantSpec, specs: dict[str, QuantSpec], meta: dict[str, Any], layers: str,
                        not_quantized: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` as transformers/GPTQModel/vLLM read it: `spec` the base, the
    modules of `specs` with another spec as `dynamic` overrides (formats/mixed.py), the float linears under
    `layers` ("model.layers.") skipped."""
    config = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "desc_act": meta.get("act_order") == "group",  # static: g_idx = j // group_size, nothing to permute
        "static_groups": meta.get("act_order") == "static",
        "sym": spec.sym,
        "true_sequential": bool(meta.get("true_sequential", True)),
        "damp_percent": float(meta.get("damp", 0.01)),
        "pack_dtype": "int32",
        "lm_head": False,
        "meta": {"quantizer": [f"geminicompress:{__version__}"]},
    }
    # GPTQModel's per-module override: "-:<regex>" leaves a matching module in float.
    skipped = {f"-:^{name.replace('.', '[.]')}$": {} for name in not_quantized if name.startswith(layers)}
    dynamic = {**gptq_dynamic(specs, spec), **skipped}
    if dynamic:
        config["dynamic"] = dynamic
    return config


def write_quantize_config(out: Path, config: dict[str, Any]) -> None:
    """quantize_config.json beside config.json: the quantization_config without `meta` (GPTQModel reads
    `dynamic` here)."""
    quantize_config = {k: v for k, v in config.items() if k != "meta"}
    (out / "quantize_config.json").write_text(json.dumps(quantize_config, indent=2) + "\n")


def writer(model: nn.Module, dtype: torch.dtype, specs: dict[str, QuantSpec], meta: dict[str, Any],
           qweights: QWeights) -> PackedWriter:
    """The per-layer writer of GPTQ v1 (+ quantize_config.json); mixed precision as `dynamic` overrides."""
    layers = arch_for(model).layers + "."
    return PackedWriter(model, dtype, specs, qweights, PackedLayout(
        KEY, pack_gptq, unpack_gptq, SUFFIXES,
        lambda spec, all_specs, nq: quantization_config(spec, all_specs, meta, layers, nq), write_quantize_config))


def reader(path: Path, config: dict) -> ModuleReader:
    """How a GPTQ v1 (or v2) linear is read: a `DequantLinear` at its (possibly `dynamic`) spec."""
    qc = config["quantization_config"]
    try:
        spec = QuantSpec(int(qc["bits"]), int(qc.get("group_size", -1)), bool(qc.get("sym", True)))
    except KeyError as exc:
        raise GeminiError(f"{path}: quantization_config lacks {exc}") from exc
    v1 = str(qc.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    dynamic = qc.get("dynamic")
    return dequant_reader(SUFFIXES, lambda name, t: unpack_gptq(t, dynamic_spec(dynamic, name, spec), v1,
                                                                torch.uint8))  # DequantLinear keeps bytes
