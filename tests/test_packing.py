"""Packing: bit streams, GPTQ v1 and compressed-tensors round trips for every bits/group/act-order/sym."""

import itertools

import pytest
import torch

from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.core.grid import QuantSpec
from geminicompress.formats.bits import pack_bits, packed_width, unpack_bits
from geminicompress.formats.gptq import pack_gptq, unpack_gptq
from geminicompress.formats.pack_quantized import pack_ct, unpack_ct

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [32, 64, 96, 40])
def test_bit_stream_round_trip(bits, n):
    codes = torch.randint(0, 2**bits, (3, 5, n), generator=torch.Generator().manual_seed(n + bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, packed_width(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.int32))
    small = unpack_bits(packed, bits, n, torch.uint8)  # what DequantLinear keeps: a byte a code, not four
    assert small.dtype == torch.uint8 and torch.equal(small.to(torch.int32), codes.to(torch.int32))


def test_bit_stream_known_words():
    # 4-bit: eight codes per word, the first in the lowest bits
    assert pack_bits(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4).item() == 0x87654321 - 2**32
    # 3-bit: 32 codes fill exactly 3 words; code 10 straddles words 0/1 (2 low bits + 1 high bit)
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 10] = 0b111
    words = pack_bits(codes, 3)[0].tolist()
    assert words == [-(2**31) + 2**30, 1, 0]  # bits 30, 31 of word 0 and bit 0 of word 1
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 21] = 0b110  # straddles words 1/2 at bit 63: low bit 0 in word 1, high bits 1..2 in word 2
    assert pack_bits(codes, 3)[0].tolist() == [0, 0, 0b11]
    # 8-bit: four codes per word, the first in the lowest byte (the byte view and the bit arithmetic agree)
    assert pack_bits(torch.tensor([[0x01, 0x02, 0x03, 0xF4]]), 8).item() == 0xF4030201 - 2**32
    assert pack_bits(torch.tensor([[0x01, 0x02, 0x03, 0xF4, 0x05]]), 8).tolist() == [[0xF4030201 - 2**32, 0x05]]


def test_8bit_byte_view_equals_the_bit_stream():
    codes = torch.randint(0, 256, (7, 64), generator=torch.Generator().manual_seed(8))
    packed = pack_bits(codes, 8)  # n % 4 == 0: the byte view
    words = codes[:, 0::4] | codes[:, 1::4] << 8 | codes[:, 2::4] << 16 | codes[:, 3::4] << 24
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, words)
    assert torch.equal(unpack_bits(packed, 8, 64), codes.to(torch.int32))
    assert torch.equal(unpack_bits(packed, 8, 61), codes[:, :61].to(torch.int32))  # the general path's n


def _quantized(bits: int, group: int, act_order: bool, sym: bool, static: bool = False):
    gen = torch.Generator().manual_seed(bits * 7 + group)
    X = torch.randn(256, 64, generator=gen) * torch.linspace(0.2, 2.0, 64)
    W = torch.randn(32, 64, generator=gen)
    qw, _ = gptq_quantize(W, 2 * X.T @ X / 256, QuantSpec(bits, group, sym), act_order=act_order, static_groups=static)
    qw.scales = qw.scales.half().float()  # both formats may store scales in fp16
    return qw


COMBOS = list(itertools.product([2, 3, 4, 8], [-1, 32], [False, True], [True, False]))


def _same(a, b):
    assert torch.equal(a.q.to(torch.int32), b.q.to(torch.int32))
    assert torch.equal(a.zeros.to(torch.int32), b.zeros.to(torch.int32))
    assert torch.equal(a.g_idx, b.g_idx)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("bits,group,act_order,sym", COMBOS)
def test_gptq_format_round_trip(bits, group, act_order, sym):
    qw = _quantized(bits, group, act_order, sym)
    packed = pack_gptq(qw)
    groups = qw.spec.groups(64)
    assert packed["qweight"].shape == (64 * bits // 32, 32) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (groups, 32 * bits // 32) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (groups, 32) and packed["scales"].dtype == torch.float16
    assert packed["g_idx"].shape == (64,) and packed["g_idx"].dtype == torch.int32
    _same(unpack_gptq(packed, qw.spec), qw)
    small = unpack_gptq(packed, qw.spec, codes=torch.uint8)  # what the reader gives DequantLinear
    assert small.q.dtype == torch.uint8
    _same(small, qw)


def test_gptq_v1_stores_zero_minus_one():
    qw = _quantized(4, 32, False, True)
    zeros = unpack_bits(pack_gptq(qw)["qzeros"], 4, 32)
    assert torch.all(zeros == 7)  # symmetric 4-bit zero 8, stored as 7


@pytest.mark.parametrize("bits,group,act_order,sym", COMBOS)
def test_compressed_tensors_round_trip(bits, group, act_order, sym):
    qw = _quantized(bits, group, act_order, sym)
    packed = pack_ct(qw, torch.float16, with_g_idx=act_order)
    assert packed["weight_packed"].shape == (32, packed_width(64, bits))
    assert packed["weight_shape"].tolist() == [32, 64]
    assert ("weight_zero_point" in packed) == (not sym)
    if not sym:
        assert packed["weight_zero_point"].shape == (packed_width(32, bits), qw.spec.groups(64))
    _same(unpack_ct(packed, qw.spec), qw)
    _same(unpack_ct(packed, qw.spec, torch.uint8), qw)


def test_compressed_tensors_static_groups_need_no_g_idx():
    qw = _quantized(4, 32, True, True, static=True)
    packed = pack_ct(qw, torch.float16, with_g_idx=False)
    _same(unpack_ct(packed, qw.spec), qw)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_a_block_of_rows_at_a_time_equals_the_whole_matrix(monkeypatch, bits):
    """Rows are independent streams: packing (and unpacking) in blocks of rows, with a last partial block and
    leading dimensions, gives the same words as one pass."""
    from geminicompress.formats import bits as bits_mod

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 23, 70), generator=g, dtype=torch.int32)
    whole_packed = bits_mod._pack_rows(codes, bits)
    whole_codes = bits_mod._unpack_rows(whole_packed, bits, 70)
    monkeypatch.setattr(bits_mod, "_ROWS", 5)  # 69 rows: 14 blocks, the last of 4
    assert torch.equal(pack_bits(codes, bits), whole_packed)
    assert torch.equal(unpack_bits(whole_packed, bits, 70), whole_codes)
    assert torch.equal(whole_codes, codes)


@pytest.mark.parametrize("group", [-1, 32])
def test_a_big_dequantized_linear_computes_a_block_of_rows_at_a_time(monkeypatch, group):
    """DequantLinear rebuilds a weight bigger than its block (an INT8 or 4-bit output head: 4 GiB of float32
    at 262,144 x 4,096, and twice that on the way) a block of rows at a time: the same output as the whole
    weight, and its rows are the whole weight's."""
    from geminicompress.formats import dequant

    qw = _quantized(8 if group == -1 else 4, group, False, True)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    module = dequant.DequantLinear(qw, bias)
    want = torch.nn.functional.linear(x, qw.dequantize(), bias)
    assert torch.equal(module.weight, qw.dequantize())
    assert torch.equal(module.weight_rows(7, 19), qw.dequantize()[7:19])
    whole = module(x)
    assert torch.allclose(whole, want, rtol=0, atol=1e-5)
    for rows in (5, 1):
        monkeypatch.setattr(dequant, "BLOCK_BYTES", 4 * 64 * rows)
        got = module(x)
        assert got.shape == (3, 5, 32)
        assert torch.allclose(got, whole, rtol=0, atol=1e-5)
