"""GGUF's block types as pure math: our codes and scales written as llama.cpp's blocks, never re-quantized.

A GGUF block holds 32 consecutive weights of one row (ggml-common.h, `block_q4_0` etc.):

| type | bytes | holds | weight |
|---|---|---|---|
| Q4_0 | 18 | fp16 d, 32 4-bit q | d · (q − 8) |
| Q4_1 | 20 | fp16 d, fp16 m, 32 4-bit q | d · q + m |
| Q5_0 | 22 | fp16 d, 32-bit high bits, 32 4-bit low bits | d · (q − 16) |
| Q8_0 | 34 | fp16 d, 32 int8 q | d · q |

Our grid (core/grid.py) is w = s · (q − z) with s rounded to fp16 before the weights were (gptq/awq/gguf
store fp16 scales), so for a group that covers whole 32-column blocks:
- symmetric b ≤ 4 (z = 2^(b−1)): Q4_0 with d = s, q4 = q − z + 8 (narrower codes sit in the middle of 0..15);
- symmetric 5-bit: Q5_0 with q5 = q (z = 16);
- symmetric 6..8-bit, and asymmetric 5..7-bit (|q − z| ≤ 127): Q8_0 with q8 = q − z;
- asymmetric b ≤ 4: Q5_0 with q5 = q − z + 16 (|q − z| ≤ 15: exact), or Q4_1 with d = s, q4 = q and
  m = fp16(−s·z): the one type here that rounds (by at most half an fp16 ulp of 15·s; `Encoded.max_step_error`
  says how much in units of the step s).
Dequantized by llama.cpp (or `gguf.quants.dequantize`) every exact type gives d · (integer) in float32, the
product our loader computes: bit for bit. Asymmetric 8-bit (|q − z| up to 255) has no exact type: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from geminicompress.core.grid import QuantizedWeight
from geminicompress.core.errors import InputError

BLOCK = 32
ASYM_TYPES = ("q5_0", "q4_1")  # what an asymmetric <= 4-bit weight may be written as
FLOAT_TYPES = {"f16": Q.F16, "f32": Q.F32}


@dataclass
class Encoded:
    """One tensor as GGUF stores it: `data` uint8 (rows, bytes per row) for a block type, else float16/32 (rows,
    cols); `shape` (rows, cols) in torch order; `max_step_error` the largest |stored − ours| / s (Q4_1's m)."""

    data: np.ndarray
    qtype: Q
    shape: tuple[int, int]
    max_step_error: float = 0.0


def _d(d: torch.Tensor) -> torch.Tensor:
    """(rows, nb) fp16-exact floats -> (rows, nb, 2) bytes of their fp16."""
    half = d.to(torch.float16).contiguous()
    return half.view(torch.uint8).reshape(*d.shape, 2)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(rows, nb, 32) values in 0..15 -> (rows, nb, 16) bytes: element j low, element j + 16 high."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _rows(parts: list[torch.Tensor]) -> np.ndarray:
    """Concatenate per-block byte fields (rows, nb, k_i) into (rows, nb · Σk) uint8."""
    blocks = torch.cat(parts, dim=-1)
    return blocks.reshape(blocks.shape[0], -1).numpy()


def pack_q4_0(d: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """d: (rows, nb) fp16-exact; q: (rows, nb·32) in 0..15 -> (rows, nb·18) bytes."""
    return _rows([_d(d), _nibbles(q.reshape(*d.shape, BLOCK))])


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """d, m: (rows, nb) fp16-exact; q: (rows, nb·32) in 0..15 -> (rows, nb·20) bytes."""
    return _rows([_d(d), _d(m), _nibbles(q.reshape(*d.shape, BLOCK))])


def pack_q5_0(d: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """d: (rows, nb) fp16-exact; q: (rows, nb·32) in 0..31 -> (rows, nb·22) bytes."""
    q = q.reshape(*d.shape, BLOCK).to(torch.int64)
    bit = torch.arange(BLOCK, dtype=torch.int64)
    qh = ((q >> 4) << bit).sum(-1)  # (rows, nb): bit j = high bit of element j
    qh_bytes = torch.stack([(qh >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8)  # little-endian
    return _rows([_d(d), qh_bytes, _nibbles(q & 0x0F)])


def pack_q5_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """d, m: (rows, nb) fp16-exact; q: (rows, nb·32) in 0..31 -> (rows, nb·24) bytes (Q5_0's bits after d and m)."""
    return _rows([_d(d), _d(m), torch.from_numpy(pack_q5_0(d, q)).reshape(
        *d.shape, 22)[..., 2:]])


def pack_q8_0(d: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """d: (rows, nb) fp16-exact; q: (rows, nb·32) in −128..127 -> (rows, nb·34) bytes."""
    return _rows([_d(d), q.reshape(*d.shape, BLOCK).to(torch.int8).view(torch.uint8)])


def block_params(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32-column block's (scale, zero): (out, nb) each. InputError when a block spans two groups
    (a group size that is not a multiple of 32, or act-order's permuted groups)."""
    in_f = qw.q.shape[1]
    if in_f % BLOCK:
        raise InputError(f"GGUF stores rows in blocks of {BLOCK}, and {in_f} input features are not a multiple of it")
    g = qw.g_idx.to(torch.int64).reshape(in_f // BLOCK, BLOCK)  # (nb, 32)
    if not bool((g == g[:, :1]).all()):
        raise InputError("GGUF needs each block of 32 input columns to share one scale: use a group size that is a "
                         "multiple of 32 (or per channel) and --act-order static or none")
    first = g[:, 0]
    return qw.scales.float()[:, first], qw.zeros.to(torch.int64)[:, first]


def weight_type(qw: QuantizedWeight, asym: str = "q5_0") -> Q:
    """The GGUF type our codes of `qw` are written as (the table in the module docstring)."""
    bits = qw.spec.bits
    if bool((qw.zeros == 2 ** (bits - 1)).all()):  # symmetric (an asymmetric grid whose zeros all sit there is too)
        return Q.Q4_0 if bits <= 4 else Q.Q5_0 if bits == 5 else Q.Q8_0
    if bits <= 4:
        return Q.Q4_1 if asym == "q4_1" else Q.Q5_0
    if bits < 8:
        return Q.Q8_0
    raise InputError("asymmetric 8-bit codes have no exact GGUF type (Q8_0 holds −128..127 around zero): "
                     "use symmetric 8-bit, or 4-bit with zero points")


def encode_quantized(qw: QuantizedWeight, asym: str = "q5_0") -> Encoded:
    """`qw` as GGUF blocks of the type `weight_type` picks."""
    qtype = weight_type(qw, asym)
    s, z = block_params(qw)  # (out, nb)
    out_f, in_f = qw.q.shape
    zc = z.repeat_interleave(BLOCK, dim=1)  # (out, in)
    centred = qw.q.to(torch.int64) - zc  # q − z
    if qtype == Q.Q4_0:
        return Encoded(pack_q4_0(s, centred + 8), qtype, (out_f, in_f))
    if qtype == Q.Q8_0:
        return Encoded(pack_q8_0(s, centred), qtype, (out_f, in_f))
    if qtype == Q.Q5_0:
        return Encoded(pack_q5_0(s, centred + 16), qtype, (out_f, in_f))
    m = (-s * z.float()).to(torch.float16).float()  # Q4_1: the one rounding
    err = float(((m + s * z.float()).abs() / s.clamp_min(torch.finfo(torch.float32).tiny)).max())
    return Encoded(pack_q4_1(s, m, qw.q), qtype, (out_f, in_f), max_step_error=err)


def encode_as(qw: QuantizedWeight, qtype: Q) -> Encoded:
    """`qw` as the legacy type a mix names for its tensor (formats/gguf_mix.py): Q4_0 / Q5_0 / Q8_0 hold
    symmetric codes (and Q5_0 asymmetric <= 4-bit ones) exactly, Q4_1 / Q5_1 asymmetric 4 / 5-bit codes with
    their offset m = fp16(−s·z) rounded. InputError where the codes do not fit the type."""
    bits, sym = qw.spec.bits, bool((qw.zeros == 2 ** (qw.spec.bits - 1)).all())
    fits = {Q.Q4_0: sym and bits <= 4, Q.Q5_0: bits <= 5 and (sym or bits <= 4), Q.Q8_0: sym or bits < 8,
            Q.Q4_1: bits <= 4, Q.Q5_1: bits <= 5}
    if not fits.get(qtype, False):
        raise InputError(f"{'symmetric' if sym else 'asymmetric'} {bits}-bit codes do not fit GGUF {qtype.name}")
    s, z = block_params(qw)
    out_f, in_f = qw.q.shape
    centred = qw.q.to(torch.int64) - z.repeat_interleave(BLOCK, dim=1)
    if qtype == Q.Q4_0:
        return Encoded(pack_q4_0(s, centred + 8), qtype, (out_f, in_f))
    if qtype == Q.Q5_0:
        return Encoded(pack_q5_0(s, centred + 16), qtype, (out_f, in_f))
    if qtype == Q.Q8_0:
        return Encoded(pack_q8_0(s, centred), qtype, (out_f, in_f))
    m = (-s * z.float()).to(torch.float16).float()
    err = float(((m + s * z.float()).abs() / s.clamp_min(torch.finfo(torch.float32).tiny)).max())
    pack = pack_q4_1 if qtype == Q.Q4_1 else pack_q5_1
    return Encoded(pack(s, m, qw.q), qtype, (out_f, in_f), max_step_error=err)


def encode_float(w: torch.Tensor, qtype: Q, rows_per_chunk: int = 4096) -> Encoded:
    """A float tensor as F32, F16 or Q8_0 (quantized as llama.cpp does: per block d = max|w| / 127), a chunk of
    rows at a time (an 8B model's embedding is 0.5 G weights). 1-D tensors (norms, biases) are always F32."""
    w = w.detach()
    if w.dim() == 1:
        qtype = Q.F32
    if qtype not in (Q.F32, Q.F16, Q.Q8_0):
        raise ValueError(f"float tensors are written as F32, F16 or Q8_0, not {qtype.name}")
    rows, cols = w.shape[0], (w.shape[1] if w.dim() == 2 else None)
    if qtype == Q.Q8_0 and cols % BLOCK:
        raise InputError(f"Q8_0 needs a multiple of {BLOCK} columns, got {cols}: use --gguf-embeddings f16")
    if w.dim() == 1:
        return Encoded(w.float().numpy(), Q.F32, (rows,))
    width = cols // BLOCK * 34 if qtype == Q.Q8_0 else cols
    data = np.empty((rows, width), dtype={Q.F32: np.float32, Q.F16: np.float16, Q.Q8_0: np.uint8}[qtype])
    for r in range(0, rows, rows_per_chunk):
        part = w[r:r + rows_per_chunk].float()
        if qtype == Q.Q8_0:  # llama.cpp's reference rounding
            data[r:r + rows_per_chunk] = quants.quantize(part.numpy(), Q.Q8_0)
        else:
            data[r:r + rows_per_chunk] = part.to(torch.float16 if qtype == Q.F16 else torch.float32).numpy()
    return Encoded(data, qtype, (rows, cols))


def permute_rows(enc: Encoded, perm: torch.Tensor) -> Encoded:
    """The tensor with its rows reordered (llama.cpp's Q/K permutation): a row's blocks move whole."""
    return Encoded(np.ascontiguousarray(enc.data[perm.numpy()]), enc.qtype, enc.shape, enc.max_step_error)


def qk_permutation(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's rows of q_proj/k_proj from HF's rotate-half layout to
    interleaved pairs: (heads, 2, d/2) -> (heads, d/2, 2). Returns the source row of each written row."""
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
