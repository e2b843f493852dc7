"""K-quant and IQ4 codes (core/kgrid.KCodes) as the bytes of llama.cpp's blocks (ggml-common.h), and back.

| type | block bytes, in order |
|---|---|
| Q2_K | scales[16] (sc low nibble, m high), qs[64] (2-bit), fp16 d, fp16 dmin |
| Q3_K | hmask[32] (the codes' third bit), qs[64] (low 2 bits), scales[12] (6-bit, + 32), fp16 d |
| Q4_K | fp16 d, fp16 dmin, scales[12] (6-bit sc and m), qs[128] |
| Q5_K | fp16 d, fp16 dmin, scales[12], qh[32] (fifth bits), qs[128] |
| Q6_K | ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], fp16 d |
| IQ4_NL | fp16 d, qs[16] |
| IQ4_XS | fp16 d, uint16 scales_h (high 2 bits), scales_l[4] (low 4 bits; 6-bit sc + 32), qs[128] |

Codes of 2 and 3 bits: byte l of each 32-byte group of a 128-weight half holds weights l, l+32, l+64, l+96 at bit
shifts 0, 2, 4, 6; 4-bit codes of K types: weights l and l+32 of each 64 in one byte; IQ4: l and l+16 of each 32.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from geminicompress.core.kgrid import KCodes, KTYPES

QTYPES = {name: getattr(Q, name) for name in KTYPES}


def _f16(d: np.ndarray) -> np.ndarray:
    """(B,) float32 fp16 values -> (B, 2) bytes."""
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _crumbs(L: np.ndarray) -> np.ndarray:
    """(B, 256) codes of 2 bits -> (B, 64): per 128-weight half, byte l = L[l] | L[l+32]<<2 | L[l+64]<<4 | L[l+96]<<6."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _uncrumbs(qs: np.ndarray) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _nibbles64(L: np.ndarray) -> np.ndarray:
    """(B, 256) 4-bit values -> (B, 128): per 64 weights, byte l = L[l] | L[l+32]<<4."""
    L = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def _unnibbles64(qs: np.ndarray) -> np.ndarray:
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256)


def _nibbles32(L: np.ndarray) -> np.ndarray:
    """(B, n·32) 4-bit values -> (B, n·16): per 32 weights, byte l = L[l] | L[l+16]<<4 (IQ4's order)."""
    L = L.reshape(L.shape[0], -1, 2, 16).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(L.shape[0], -1)


def _unnibbles32(qs: np.ndarray) -> np.ndarray:
    qs = qs.reshape(qs.shape[0], -1, 1, 16)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(qs.shape[0], -1)


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(B, 8) 6-bit scales and mins -> (B, 12) bytes (`get_scale_min_k4`'s layout)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _unscales_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.int32), mn.astype(np.int32)


def _scales_q3(ls: np.ndarray) -> np.ndarray:
    """(B, 16) 6-bit values -> (B, 12) bytes: low nibbles of 0..7 / 8..15 in bytes 0..7, high 2 bits in 8..11."""
    ls = ls.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, :8] = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    hi = (ls >> 4).reshape(-1, 4, 4)  # [j // 4, j % 4]
    out[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return out


def _unscales_q3(s: np.ndarray) -> np.ndarray:
    low = np.concatenate([s[:, :8] & 15, s[:, :8] >> 4], axis=1)
    hi = np.stack([(s[:, 8:] >> (2 * k)) & 3 for k in range(4)], axis=1).reshape(-1, 16)
    return (low | (hi << 4)).astype(np.int32)


def pack(codes: KCodes) -> np.ndarray:
    """(rows, nsb · block_bytes) uint8: the tensor's blocks as llama.cpp stores them."""
    t = codes.ktype
    rows, cols = codes.shape
    nsb = cols // t.super
    L = codes.q.reshape(-1, t.super)
    d = codes.d.reshape(-1)
    sc = codes.sc.reshape(rows * nsb, -1)
    if t.name == "IQ4_NL":
        parts = [_f16(d), _nibbles32(L)]
    elif t.name == "IQ4_XS":
        ls = (sc + 32).astype(np.uint16)
        high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(1).astype(np.uint16)
        low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        parts = [_f16(d), high.view(np.uint8).reshape(-1, 2), low.astype(np.uint8), _nibbles32(L)]
    elif t.name == "Q2_K":
        m = codes.m.reshape(rows * nsb, -1)
        parts = [(sc | (m << 4)).astype(np.uint8), _crumbs(L), _f16(d), _f16(codes.dmin.reshape(-1))]
    elif t.name == "Q3_K":
        hbit = (L >> 2).reshape(-1, 8, 32).astype(np.uint8)  # bit j // 32 of byte j % 32
        hmask = (hbit << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(1).astype(np.uint8)
        parts = [hmask, _crumbs(L & 3), _scales_q3(sc + 32), _f16(d)]
    elif t.name in ("Q4_K", "Q5_K"):
        m = codes.m.reshape(rows * nsb, -1)
        parts = [_f16(d), _f16(codes.dmin.reshape(-1)), _scales_k4(sc, m)]
        if t.name == "Q5_K":
            hb = (L >> 4).reshape(-1, 8, 32).astype(np.uint8)  # bit k of qh[l]: weight 32k + l's fifth bit
            parts.append((hb << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(1).astype(np.uint8))
        parts.append(_nibbles64(L & 15))
    else:  # Q6_K
        Lh = L.reshape(-1, 2, 4, 32).astype(np.uint8)  # [half, quarter, l]
        ql = np.concatenate([(Lh[:, :, 0] & 15) | ((Lh[:, :, 2] & 15) << 4),
                             (Lh[:, :, 1] & 15) | ((Lh[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
        qh = ((Lh[:, :, 0] >> 4) | ((Lh[:, :, 1] >> 4) << 2) | ((Lh[:, :, 2] >> 4) << 4)
              | ((Lh[:, :, 3] >> 4) << 6)).reshape(-1, 64)
        parts = [ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)]
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape[1] == t.block_bytes, (t.name, blocks.shape)
    return blocks.reshape(rows, nsb * t.block_bytes)


def unpack(data: np.ndarray, type_name: str, cols: int) -> KCodes:
    """The KCodes of (rows, bytes) blocks of `type_name` holding `cols` weights per row."""
    t = KTYPES[type_name]
    rows = data.shape[0]
    nsb = cols // t.super
    b = data.reshape(rows * nsb, t.block_bytes)
    f16 = lambda a: a.copy().view(np.float16).astype(np.float32).reshape(rows, nsb)  # noqa: E731
    dmin = m = None
    if t.name == "IQ4_NL":
        d, L, sc = f16(b[:, :2]), _unnibbles32(b[:, 2:]), np.ones((rows * nsb, 1), np.int32)
    elif t.name == "IQ4_XS":
        d = f16(b[:, :2])
        high = b[:, 2:4].copy().view(np.uint16).reshape(-1, 1) >> (2 * np.arange(8, dtype=np.uint16))
        low = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
        sc = (low.astype(np.int32) | ((high & 3).astype(np.int32) << 4)) - 32
        L = _unnibbles32(b[:, 8:])
    elif t.name == "Q2_K":
        sc, m = (b[:, :16] & 15).astype(np.int32), (b[:, :16] >> 4).astype(np.int32)
        L, d, dmin = _uncrumbs(b[:, 16:80]), f16(b[:, 80:82]), f16(b[:, 82:84])
    elif t.name == "Q3_K":
        hbit = (b[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        L = _uncrumbs(b[:, 32:96]) | (hbit.reshape(-1, 256) << 2)
        sc, d = _unscales_q3(b[:, 96:108]) - 32, f16(b[:, 108:110])
    elif t.name in ("Q4_K", "Q5_K"):
        d, dmin = f16(b[:, :2]), f16(b[:, 2:4])
        sc, m = _unscales_k4(b[:, 4:16])
        L = _unnibbles64(b[:, -128:])
        if t.name == "Q5_K":
            hb = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            L = L | (hb.reshape(-1, 256) << 4)
    else:  # Q6_K
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = np.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        L = (low | (high << 4)).reshape(-1, 256)
        sc, d = b[:, 192:208].copy().view(np.int8).astype(np.int32), f16(b[:, 208:210])
    return KCodes(t, L.astype(np.uint8).reshape(rows, cols), d, sc.reshape(rows, -1),
                  dmin, None if m is None else m.reshape(rows, -1))
