"""The AWQ GEMM checkpoint layout (AutoAWQ `WQLinear_GEMM`, read by transformers/GPTQModel/vLLM).

Per quantized linear with weight (out, in), 4-bit codes q, groups of `group_size` input columns:
- `qweight` int32 (in, out/8): row j packs the codes q[:, j] of 8 consecutive outputs into one word,
  nibble i (bits 4i..4i+3) holding output column AWQ_ORDER[i] of the eight (interleaved for the kernel);
- `qzeros`  int32 (groups, out/8): the zero points, packed the same way, stored as they are (no −1,
  unlike GPTQ v1);
- `scales`  float16 (groups, out).
w[o, j] = scales[g, o] · (q[o, j] − zeros[g, o]) with g = j // group_size (AWQ has no g_idx).
config.json: quantization_config = {quant_method: awq, bits: 4, group_size, zero_point, version: gemm}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.grid import QuantizedWeight, QuantSpec, group_index
from geminicompress.core.rows import BLOCK_BYTES, rows_within, spans
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats.dequant import dequant_reader
from geminicompress.formats.groups import Groups
from geminicompress.formats.reader import ModuleReader
from geminicompress.formats.writer import PackedLayout, PackedWriter, QWeights

KEY = "awq"

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
BITS = 4
PACK = 32 // BITS
SUFFIXES = ("qweight", "qzeros", "scales")
FIX = "use --format compressed-tensors or --format dense"
GROUPS = Groups(per_channel=False,  # whole groups only: AWQ has no per-channel layout (formats/groups.py)
                refusal="the AWQ format needs a group size dividing every layer's input size; {name} has {in_f} "
                        f"inputs and the group size is {{group}} (pick a divisor of {{in_f}}, or {FIX})")


def detect(qc: dict[str, Any]) -> bool:
    return str(qc.get("quant_method", "")).lower() == "awq"


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Raise InputError when the AWQ GEMM layout cannot hold this (out, in) weight at `spec` (its groups:
    `GROUPS`)."""
    if spec.bits != BITS:
        raise InputError(f"the AWQ format holds 4-bit weights only, not {spec.bits}-bit: {FIX}")
    if out_f % PACK:
        raise InputError(f"the AWQ format packs 8 outputs per word; {name} has {out_f} outputs: {FIX}")


def _pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes in [0, 16) -> int32 (rows, cols/8), AWQ's interleaved nibble order, a block of rows
    at a time (an int64 copy of the whole matrix would be 8 bytes per code)."""
    rows, cols = codes.shape
    out = torch.empty(rows, cols // PACK, dtype=torch.int32, device=codes.device)
    shifts = torch.arange(PACK, device=codes.device) * BITS
    for start, stop in spans(rows, rows_within(cols, BLOCK_BYTES, 8)):
        grouped = codes[start:stop].to(torch.int64).reshape(stop - start, cols // PACK, PACK)[..., list(AWQ_ORDER)]
        words = (grouped << shifts).sum(-1)  # disjoint nibbles: sum == or
        out[start:stop] = words - ((words >> 31) << 32)  # uint32 bits as int32
    return out


def _unpack_columns(packed: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """int32 (rows, cols/8) -> codes (rows, cols) as `dtype`, a block of rows at a time; uint8 (what
    DequantLinear keeps) is a quarter of int32's bytes."""
    rows, words = packed.shape
    out = torch.empty(rows, words * PACK, dtype=dtype, device=packed.device)
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * BITS
    for start, stop in spans(rows, rows_within(words * PACK, BLOCK_BYTES, 4)):
        # int32 shifts are arithmetic: the mask drops the sign bits a negative word brings down
        nibbles = (packed[start:stop].unsqueeze(-1) >> shifts) & 0xF  # (rows, cols/8, 8) in nibble order
        out[start:stop].view(stop - start, words, PACK)[..., list(AWQ_ORDER)] = nibbles.to(dtype)
    return out


def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """QuantizedWeight (codes (out, in), scales/zeros (out, groups)) -> qweight, qzeros, scales."""
    out_f, in_f = qw.q.shape
    if not torch.equal(qw.g_idx.cpu().long(), group_index(in_f, qw.spec).long()):
        raise GeminiError("the AWQ format has no g_idx: groups must be consecutive input columns")
    return {
        "qweight": _pack_columns(qw.q.t()),  # (in, out/8)
        "qzeros": _pack_columns(qw.zeros.t()),  # (groups, out/8)
        "scales": qw.scales.t().to(torch.float16).contiguous(),  # (groups, out)
    }


def unpack_awq(tensors: dict[str, torch.Tensor], spec: QuantSpec, codes: torch.dtype = torch.int32) -> QuantizedWeight:
    """The QuantizedWeight of one module's tensors, its codes as `codes` (uint8: what DequantLinear keeps)."""
    q = _unpack_columns(tensors["qweight"], codes).t().contiguous()  # (out, in)
    zeros = _unpack_columns(tensors["qzeros"]).t().contiguous()  # (out, groups)
    scales = tensors["scales"].t().float().contiguous()  # (out, groups)
    return QuantizedWeight(q, scales, zeros, group_index(q.shape[1], spec), spec)


def quantization_config(spec: QuantSpec, meta: dict[str, Any], not_quantized: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config`; modules_to_not_convert is matched by name part: the float
    linears' last names (e.g. lm_head)."""
    not_converted = sorted({n.rsplit(".", 1)[-1] for n in not_quantized})
    return {"quant_method": "awq", "bits": spec.bits, "group_size": spec.group_size,
            "zero_point": bool(meta.get("zero_point", not spec.sym)), "version": "gemm",
            "modules_to_not_convert": not_converted or None}


def writer(model: nn.Module, dtype: torch.dtype, specs: dict[str, QuantSpec], meta: dict[str, Any],
           qweights: QWeights) -> PackedWriter:
    """The per-layer writer of the AWQ GEMM layout (one spec per checkpoint)."""
    if len(set(specs.values())) != 1:
        raise InputError(f"one AWQ checkpoint holds one quantization spec, got {len(set(specs.values()))}")
    return PackedWriter(model, dtype, specs, qweights, PackedLayout(
        KEY, pack_awq, unpack_awq, SUFFIXES, lambda base, all_specs, nq: quantization_config(base, meta, nq)))


def reader(path: Path, config: dict) -> ModuleReader:
    """How an AWQ GEMM linear is read: a `DequantLinear` rebuilding its weight on the fly."""
    qc = config["quantization_config"]
    if int(qc.get("bits", BITS)) != BITS or str(qc.get("version", "gemm")).lower() != "gemm":
        raise GeminiError(f"{path}: only 4-bit AWQ in the GEMM layout loads here "
                          f"(got bits={qc.get('bits')}, version={qc.get('version')})")
    spec = QuantSpec(BITS, int(qc["group_size"]), sym=not qc.get("zero_point", True))
    return dequant_reader(SUFFIXES, lambda name, parts: unpack_awq(parts, spec, torch.uint8))
