"""K-quant and IQ4 codes: llama.cpp's dequantization of our bytes (`gguf.quants`) equals ours bit for bit, the bytes
round-trip, and the weighted searches do what they are for (benchmarks/studies/gguf/kquant_vs_llama.py compares the codes with
llama.cpp's own quantizer: 98-100% identical blocks with an importance matrix)."""

import numpy as np
import pytest
from gguf import quants

from geminicompress.core.kgrid import KTYPES, nearest_value
from geminicompress.core.kquant import quantize
from geminicompress.formats.gguf_kpack import QTYPES, pack, unpack


def _matrix(seed: int, rows: int = 24, cols: int = 512) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    w[1] = 0.0  # an all-zero row: d = 0 blocks
    w[2, :256] *= 40  # a loud super-block
    w[3, 5] = 1.5  # an outlier
    return w


@pytest.mark.parametrize("name", list(KTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_llama_cpp_dequantizes_our_bytes_to_our_weights_bit_for_bit(name, weighted):
    w = _matrix(len(name))
    imp = (np.random.default_rng(1).random(512) ** 3).astype(np.float32) if weighted else None
    codes = quantize(w, name, imp)
    data = pack(codes)
    t = KTYPES[name]
    assert data.shape == (24, 512 // t.super * t.block_bytes)
    ours = codes.dequantize()
    theirs = quants.dequantize(data, QTYPES[name])
    assert theirs.dtype == np.float32 and np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))
    back = unpack(data, name, 512)
    assert np.array_equal(back.q, codes.q) and np.array_equal(back.sc, codes.sc) and np.array_equal(back.d, codes.d)
    if t.has_min:
        assert np.array_equal(back.m, codes.m) and np.array_equal(back.dmin, codes.dmin)


def test_error_falls_with_bits_and_the_importance_is_honoured():
    w = _matrix(7, rows=64)
    rel = {n: float(np.square(quantize(w, n).dequantize() - w).sum() / np.square(w).sum())
           for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
    assert rel["Q2_K"] > rel["Q3_K"] > rel["Q4_K"] > rel["Q5_K"] > rel["Q6_K"]
    assert rel["Q4_K"] < 0.01 and rel["Q6_K"] < 0.001
    imp = np.full(512, 1e-3, np.float32)
    imp[::8] = 1.0  # one column in 8 matters
    for name in ("Q3_K", "Q4_K", "IQ4_NL"):
        err = [float((imp * np.square(quantize(w, name, i).dequantize() - w)).sum()) for i in (None, imp)]
        assert err[1] < 0.9 * err[0], name


def test_nearest_value_on_the_non_linear_grid_is_llama_cpp_s_best_index():
    t = KTYPES["IQ4_NL"]
    x = np.array([-200, -127, -115.5, -115.4, 0.0, 7.0, 6.9, 113, 300], np.float32)
    # ties go to the upper value (-115.5 is halfway between -127 and -104), as best_index_int8
    assert nearest_value(t, x).tolist() == [0, 0, 1, 1, 8, 9, 8, 15, 15]
