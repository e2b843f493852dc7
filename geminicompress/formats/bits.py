"""b-bit codes <-> int32 words, as one dense little-endian bit stream along the last dimension.

Code k of a row occupies bits [k·b, (k+1)·b) of the row's stream; word w holds stream bits
[32w, 32w + 32). For b in {2, 4, 8} this is the familiar "32/b codes per word, first code in the
lowest bits"; for b = 3 every 32 codes fill exactly 3 words and codes 10 and 21 straddle two words.
GPTQ (AutoGPTQ/GPTQModel) and compressed-tensors (>= 0.10) both use this stream layout.
"""

from __future__ import annotations

import sys

import torch

_WORD = 32
# 8-bit codes in little-endian words are the bytes themselves: a view, no bit arithmetic
_BYTES = sys.byteorder == "little"


def packed_width(n: int, bits: int) -> int:
    """int32 words holding n codes of `bits` bits."""
    return -(-n * bits // _WORD)


def _layout(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the 32 codes of one chunk (= `bits` words): word index, bit offset, bits spilling over."""
    start = torch.arange(_WORD, device=device, dtype=torch.int64) * bits
    offset = start % _WORD
    return start // _WORD, offset, (offset + bits - _WORD).clamp(min=0)


_ROWS = 512  # rows per block: the int64 working copies are ~8x the int32 codes (3 GB for a 58.7M-code matrix at once)


def _by_rows(fn, t: torch.Tensor, *args: int) -> torch.Tensor:
    """fn over blocks of rows of t viewed as (rows, last dim): rows are independent streams."""
    *lead, last = t.shape
    flat = t.reshape(-1, last)
    if flat.shape[0] <= _ROWS:
        out = fn(flat, *args)
    else:
        out = torch.cat([fn(flat[i:i + _ROWS], *args) for i in range(0, flat.shape[0], _ROWS)])
    return out.reshape(*lead, out.shape[-1])


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) integers in [0, 2^bits) -> int32 (..., packed_width(n, bits)), a block of rows at a time."""
    if bits == 8 and _BYTES and codes.shape[-1] % 4 == 0:
        *lead, n = codes.shape
        flat = torch.empty(codes.shape, dtype=torch.uint8, device=codes.device).copy_(codes).reshape(-1)
        return flat.view(torch.int32).reshape(*lead, n // 4)
    return _by_rows(_pack_rows, codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """int32 (..., words) -> codes (..., n) as `dtype` in [0, 2^bits), a block of rows at a time. uint8 holds
    codes of up to 8 bits in a quarter of int32's bytes (1 GiB, not 4, for a 262,144 x 4,096 INT8 head)."""
    if bits == 8 and _BYTES and packed.dtype == torch.int32 and packed.shape[-1] * 4 >= n:
        *lead, words = packed.shape
        return packed.contiguous().reshape(-1).view(torch.uint8).reshape(*lead, 4 * words)[..., :n].to(dtype)
    return _by_rows(lambda rows, b, m: _unpack_rows(rows, b, m).to(dtype), packed, bits, n)


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    *lead, n = codes.shape
    chunks = -(-n // _WORD)
    values = torch.zeros(*lead, chunks * _WORD, dtype=torch.int64, device=codes.device)
    values[..., :n] = codes.to(torch.int64) & ((1 << bits) - 1)
    values = values.reshape(-1, chunks, _WORD)  # (rows, chunks, 32)
    word, offset, spill = _layout(bits, codes.device)
    words = torch.zeros(values.shape[0], chunks, bits + 1, dtype=torch.int64, device=codes.device)
    low = (values << offset) & 0xFFFFFFFF
    words.scatter_add_(2, word.expand_as(values), low)  # fields never overlap: add == or
    high = values >> (bits - spill)  # the spilled top bits go to the bottom of the next word
    words.scatter_add_(2, (word + 1).expand_as(values), torch.where(spill > 0, high, 0))
    words = words[..., :bits].reshape(*lead, chunks * bits)[..., : packed_width(n, bits)]
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret uint32 as int32


def _unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    *lead, width = packed.shape
    chunks = -(-n // _WORD)
    words = torch.zeros(*lead, chunks * bits + 1, dtype=torch.int64, device=packed.device)
    words[..., :width] = packed.to(torch.int64) & 0xFFFFFFFF
    stream = words[..., : chunks * bits].reshape(-1, chunks, bits)  # (rows, chunks, bits)
    after = words[..., 1 : chunks * bits + 1].reshape(-1, chunks, bits)
    word, offset, spill = _layout(bits, packed.device)
    low = stream[..., word] >> offset
    high = (after[..., word] << (bits - spill)) * (spill > 0)
    codes = (low | high) & ((1 << bits) - 1)
    return codes.reshape(*lead, chunks * _WORD)[..., :n].to(torch.int32)
