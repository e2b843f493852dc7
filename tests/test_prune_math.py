"""Pruning math on small tensors with known answers: threshold selection, masks, Wanda, SparseGPT, bitmask."""

import pytest
import torch

from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.prune.masks import nm_mask, row_mask, tensor_mask
from geminicompress.compress.prune.sparsegpt import sparsegpt_prune
from geminicompress.compress.prune.threshold import global_threshold, kth_smallest, smallest_masks
from geminicompress.compress.prune.wanda import InputNorms, wanda_mask
from geminicompress.formats.sparse_bitmask import compress, decompress, pack_bits, unpack_bits


def brute_force_masks(tensors, k):
    """Reference: sort |w| of everything concatenated, ties broken by (tensor order, flat index)."""
    flat = torch.cat([t.abs().float().flatten() for t in tensors])
    order = torch.argsort(flat, stable=True)[:k]
    pruned = torch.zeros_like(flat, dtype=torch.bool)
    pruned[order] = True
    return list(pruned.split([t.numel() for t in tensors]))


def test_threshold_exact_count_with_ties():
    # 9 values, 6 of them tied at |0.5| across two tensors: pruning 4 must take the first 2 ties.
    a = torch.tensor([0.1, 0.5, 0.5, -0.5, 0.9])
    b = torch.tensor([[0.5, -0.5], [0.2, 0.5]])
    th = global_threshold([a, b], 4)
    assert th.value == 0.5 and th.ties == (2, 0)
    masks = smallest_masks([a, b], 4)
    assert masks[0].tolist() == [True, True, True, False, False]
    assert masks[1].tolist() == [[False, False], [True, False]]
    masks = smallest_masks([a, b], 7)  # 2 below + 5 of the 6 ties
    assert sum(int(m.sum()) for m in masks) == 7
    assert masks[1].tolist() == [[True, True], [True, False]]


def test_threshold_all_equal_and_zeros():
    zeros = [torch.zeros(64), torch.zeros(8, 8)]
    for k in (0, 1, 37, 64, 128):
        assert sum(int(m.sum()) for m in smallest_masks(zeros, k)) == k


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("quantized", [False, True])
def test_streaming_selection_equals_brute_force(seed, quantized):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(r, c, generator=g) * (float(torch.rand(1, generator=g)) + 0.1)
               for r, c in [(16, 32), (8, 48), (40, 8), (3, 5)]]
    if quantized:  # heavy ties, like a model dequantized from 4-bit
        tensors = [torch.round(t * 4) / 4 for t in tensors]
    total = sum(t.numel() for t in tensors)
    for k in (1, total // 3, total // 2, total - 1, total):
        # small sample and candidate cap force the histogram refinement path too
        for kw in ({}, {"sample_size": 16, "max_candidates": 7, "bins": 8}):
            got = smallest_masks(tensors, k, **kw)
            want = brute_force_masks(tensors, k)
            assert all(torch.equal(g_.flatten(), w_) for g_, w_ in zip(got, want)), (k, kw)


def test_kth_smallest_refinement_matches_sort():
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(100, generator=g) ** 3 for _ in range(5)]  # heavy-tailed
    flat = torch.cat(tensors).abs().sort().values
    for k in (1, 100, 250, 499, 500):
        value, n_less, equal = kth_smallest(tensors, k, sample_size=10, max_candidates=3, bins=4)
        assert value == float(flat[k - 1]) and n_less == int((flat < value).sum())
        assert sum(equal) == int((flat == value).sum())


def test_global_sparsity_within_a_tenth_of_a_point():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 96, generator=g) * (i + 1) for i in range(6)]
    total = sum(t.numel() for t in tensors)
    for sparsity in (0.3, 0.4, 0.5, 0.9):
        pruned = sum(int(m.sum()) for m in smallest_masks(tensors, round(sparsity * total)))
        assert abs(pruned / total - sparsity) < 1e-3
        assert pruned == round(sparsity * total)


def test_layer_and_row_masks():
    w = torch.arange(1, 41, dtype=torch.float32).reshape(4, 10)
    keep = tensor_mask(w, 0.25)
    assert int((~keep).sum()) == 10 and (~keep).flatten()[:10].all()
    keep = row_mask(w, 0.3)
    assert (~keep).sum(1).tolist() == [3, 3, 3, 3] and (~keep)[:, :3].all()


@pytest.mark.parametrize("pattern", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_exactly_n_zeros_per_group(pattern):
    n, m = pattern
    scores = torch.randn(12, 32).abs()
    keep = nm_mask(scores, pattern)
    groups = (~keep).reshape(12, 32 // m, m)
    assert (groups.sum(-1) == n).all()
    # the pruned ones are the lowest of their group
    s = scores.reshape(12, 32 // m, m)
    assert (s[groups].reshape(12, -1, n).amax(-1) <= s[~groups].reshape(12, -1, m - n).amin(-1)).all()


def test_wanda_keeps_dominant_channel():
    torch.manual_seed(0)
    w = torch.randn(8, 16) * 0.1
    w[:, 5] = 0.01  # small weights on the dominant input channel
    norms = InputNorms(16)
    x = torch.randn(4, 32, 16)
    x[..., 5] *= 1000.0
    norms.add_batch(x)
    keep = wanda_mask(w, norms.norms(), 0.5)
    assert keep[:, 5].all()
    assert ((~keep).sum(1) == 8).all()
    keep24 = wanda_mask(w, norms.norms(), 0.5, (2, 4))
    assert keep24[:, 5].all() and ((~keep24).reshape(8, 4, 4).sum(-1) == 2).all()
    # plain magnitude would have pruned that channel first
    assert not tensor_mask(w.abs(), 0.5)[:, 5].any()


def _correlated_inputs(tokens=2048, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim ** 0.5 + torch.eye(dim) * 0.3
    return torch.randn(tokens, dim, generator=g) @ mix  # (tokens, in), strongly correlated columns


@pytest.mark.parametrize("pattern", [None, (2, 4)])
def test_sparsegpt_error_not_above_magnitude(pattern):
    x = _correlated_inputs()
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    acc = HessianAccumulator(64)
    acc.add_batch(x)
    new, keep = sparsegpt_prune(w, acc.H, 0.5, pattern, block_size=16, damp=0.01)
    assert torch.equal(new == 0, ~keep) or ((new == 0) >= ~keep).all()
    assert abs(float((~keep).float().mean()) - 0.5) < 1e-6
    if pattern:
        assert ((~keep).reshape(32, 16, 4).sum(-1) == 2).all()
    mag_keep = nm_mask(w.abs(), pattern) if pattern else tensor_mask(w.abs(), 0.5)
    err_sgpt = ((new - w) @ x.T).square().sum()
    err_mag = ((w * mag_keep - w) @ x.T).square().sum()
    assert err_sgpt <= err_mag
    assert err_sgpt < 0.8 * err_mag  # and clearly better on correlated inputs


def test_sparsegpt_zero_sparsity_keeps_weights():
    x = _correlated_inputs(256, 16)
    w = torch.randn(4, 16)
    acc = HessianAccumulator(16)
    acc.add_batch(x)
    new, keep = sparsegpt_prune(w, acc.H, 0.0, block_size=8)
    assert keep.all() and torch.allclose(new, w, atol=1e-5)


@pytest.mark.parametrize("cols", [8, 13, 64])
def test_bitpack_round_trip(cols):
    keep = torch.rand(5, cols) > 0.5
    packed = pack_bits(keep)
    assert packed.dtype == torch.uint8 and packed.shape == (5, -(-cols // 8))
    assert torch.equal(unpack_bits(packed, cols), keep)
    # little bit order: column 0 is the lowest bit of byte 0
    one = torch.zeros(1, 8, dtype=torch.bool)
    one[0, 0] = True
    assert pack_bits(one).item() == 1


@pytest.mark.parametrize("two_four", [False, True])
def test_bitmask_compress_round_trip(two_four):
    w = torch.randn(6, 16)
    keep = nm_mask(w.abs(), (2, 4)) if two_four else torch.rand(6, 16) > 0.6
    w = w * keep
    parts = compress(w, keep, two_four)
    if two_four:
        assert parts["compressed"].shape == (6, 8) and "row_offsets" not in parts
    else:
        assert parts["compressed"].numel() == int(keep.sum())
        counts = keep.sum(1)
        assert torch.equal(parts["row_offsets"], counts.cumsum(0) - counts)
    assert torch.equal(decompress(parts), w)


def _mask_whole(t: torch.Tensor, value: float, ties: int) -> torch.Tensor:
    """prune_mask as it was written first: whole-tensor float32 |w| and an int64 running count of ties."""
    a = t.abs().float()
    pruned = a < value
    if ties:
        tied = (a == value).flatten()
        pruned |= (tied & (tied.cumsum(0) <= ties)).view_as(a)
    return pruned


@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_prune_mask_in_chunks_is_the_whole_tensor_mask(chunk):
    """The chunked mask, its ties found by position, equals the whole-tensor one bitwise: bfloat16 weights tie
    often, and the ties to take run across chunk boundaries."""
    from geminicompress.compress.prune.threshold import global_threshold, prune_mask

    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(48, 40, generator=g) * 0.02).bfloat16(), (torch.randn(33, 17, generator=g) * 0.02).bfloat16()]
    total = sum(t.numel() for t in tensors)
    for sparsity in (0.0, 0.3, 0.4, 0.5, 1.0):
        th = global_threshold(tensors, round(sparsity * total))
        masks = [prune_mask(t, th.value, n, chunk=chunk) for t, n in zip(tensors, th.ties)]
        for t, n, m in zip(tensors, th.ties, masks):
            assert torch.equal(m, _mask_whole(t, th.value, n))
        assert sum(int(m.sum()) for m in masks) == round(sparsity * total)
    assert any(n for n in global_threshold(tensors, round(0.4 * total)).ties)  # the case with ties is exercised
