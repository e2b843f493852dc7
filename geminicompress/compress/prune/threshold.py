"""Global magnitude pruning: the k smallest |w| over many tensors, found without concatenating them.

One threshold over every prunable weight (global magnitude pruning, Han et al., 2015) needs the k-th
smallest |w| among ~10^8-10^11 numbers. Sorting one concatenated copy would cost several times the
model's memory. Instead, stream over the tensors, one at a time:

1. bracket: the k/total quantile of an evenly strided sample (~1M values), widened by six standard
   deviations of a sampled rank, gives [lo, hi];
2. exact pass: count the magnitudes below lo and gather only those inside [lo, hi] (well under 1% of
   them); the k-th smallest is read off the gathered values.
If the sample missed, or too many values fall inside the bracket, histogram passes narrow the bracket
instead: count the magnitudes inside [lo, hi] into `bins` equal bins, keep the bin holding the k-th
smallest, repeat until it is small enough to gather (or holds a single distinct value).

Ties at the threshold are broken deterministically (tensors in the given order, then flat index), so
exactly k weights are selected, whatever the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Threshold:
    """Prune every |w| < `value`, plus the first `ties[i]` entries (flat order) of tensor i with |w| == value."""

    value: float
    ties: tuple[int, ...]


def _magnitudes(t: Tensor) -> Tensor:
    return t.detach().abs().float().flatten()


def _bin_of(a: Tensor, lo: float, hi: float, bins: int) -> Tensor:
    """Bin index of each value in [lo, hi]; monotone non-decreasing in `a` (so a bin is an interval)."""
    scale = bins / (hi - lo)
    return ((a - lo) * scale).floor_().clamp_(0, bins - 1).long()


def _in_bracket(a: Tensor, lo: float, hi: float) -> Tensor:
    return a[(a >= lo) & (a <= hi)]


def _sample_bracket(tensors: Sequence[Tensor], k: int, total: int, size: int) -> tuple[float, float]:
    """[lo, hi] likely to contain the k-th smallest |w|, from an evenly strided sample of ~`size` values
    (tensors read from disk, such as `models.lazy.LazyTensors`, give theirs by `sample(step)`: a few
    rows of each, without reading the rest)."""
    step = max(1, total // size)
    if hasattr(tensors, "sample"):
        sample = tensors.sample(step).abs().float().sort().values
    else:
        sample = torch.cat([t.detach().flatten()[::step].abs().float() for t in tensors]).sort().values
    n = sample.numel()
    rank = k / total * n
    spread = 6.0 * math.sqrt(max(1.0, n * (k / total) * (1 - k / total))) + 2  # ~6 sd of a sampled rank
    lo = sample[max(0, math.floor(rank - spread))]
    hi = sample[min(n - 1, math.ceil(rank + spread))]
    return float(lo), float(hi)


def _refine(tensors: Sequence[Tensor], k: int, lo: float, hi: float, below: int, bins: int,
            max_candidates: int) -> tuple[float, int]:
    """Histogram passes inside [lo, hi] (holding ranks below+1..) down to a gatherable bin; (value, #smaller)."""
    while lo < hi:
        counts = torch.zeros(bins, dtype=torch.int64)
        for t in tensors:
            counts += torch.bincount(_bin_of(_in_bracket(_magnitudes(t), lo, hi), lo, hi, bins), minlength=bins)
        cum = counts.cumsum(0)
        b = int(torch.searchsorted(cum, torch.tensor([k - below])))  # first bin reaching rank k
        below += int(cum[b] - counts[b])
        inside = [a[_bin_of(a, lo, hi, bins) == b] for a in (_in_bracket(_magnitudes(t), lo, hi) for t in tensors)]
        if int(counts[b]) <= max_candidates:
            values = torch.cat(inside)
            value = float(torch.kthvalue(values, k - below).values)
            return value, below + int((values < value).sum())
        lo = min(float(v.min()) for v in inside if v.numel())
        hi = max(float(v.max()) for v in inside if v.numel())
    return lo, below


def kth_smallest(tensors: Sequence[Tensor], k: int, bins: int = 4096, max_candidates: int = 1 << 22,
                 sample_size: int = 1 << 20, total: int | None = None) -> tuple[float, int, list[int]]:
    """The k-th smallest |w| (1-based) over all `tensors`, how many |w| are smaller, and each tensor's
    count of |w| equal to it.

    Usually two passes: a strided sample brackets the k-th value, one pass counts what lies below the
    bracket and gathers what lies inside it. When the sample misses, or the bracket holds more than
    `max_candidates` values, histogram passes narrow the bracket instead (`_refine`).
    `tensors` may read each tensor from disk on access (models.lazy.LazyTensors): every pass visits them
    one at a time; `total` (their element count) then spares a pass to count them.
    """
    total = sum(t.numel() for t in tensors) if total is None else total
    if not 1 <= k <= total:
        raise ValueError(f"k={k} outside 1..{total}")
    lo, hi = _sample_bracket(tensors, k, total, sample_size)
    below, n_in, gathered = 0, [], []
    for t in tensors:
        a = _magnitudes(t)
        below += int((a < lo).sum())
        inside = _in_bracket(a, lo, hi)
        n_in.append(inside.numel())
        if sum(n_in) <= max_candidates:
            gathered.append(inside)
    if not below < k <= below + sum(n_in):  # the sample missed: search the whole range
        lo = min(float(_magnitudes(t).min()) for t in tensors)
        hi = max(float(_magnitudes(t).max()) for t in tensors)
        value, n_less = _refine(tensors, k, lo, hi, 0, bins, max_candidates)
    elif lo == hi:  # every candidate is the same value
        return lo, below, n_in
    elif len(gathered) == len(tensors):
        values = torch.cat(gathered)
        value = float(torch.kthvalue(values, k - below).values)
        return value, below + int((values < value).sum()), [int((g == value).sum()) for g in gathered]
    else:
        value, n_less = _refine(tensors, k, lo, hi, below, bins, max_candidates)
    return value, n_less, [int((_magnitudes(t) == value).sum()) for t in tensors]


def global_threshold(tensors: Sequence[Tensor], k: int, **kwargs: int | None) -> Threshold:
    """The threshold that selects exactly the k smallest |w| over all `tensors` (ties: first come first)."""
    if k == 0:
        return Threshold(float("-inf"), tuple(0 for _ in tensors))
    value, n_less, equal = kth_smallest(tensors, k, **kwargs)
    remaining = k - n_less
    ties = []
    for count in equal:
        take = min(count, remaining)
        ties.append(take)
        remaining -= take
    assert remaining == 0, "tie allocation must account for every selected weight"
    return Threshold(value, tuple(ties))


def prune_mask(t: Tensor, value: float, ties: int, chunk: int = 1 << 22) -> Tensor:
    """Bool mask (t's shape) of the weights a `Threshold` selects in one tensor: True = pruned.

    |w| is compared in float32 `chunk` elements at a time, and the first `ties` weights equal to the threshold
    (flattened order) are found by their positions: a whole-tensor float32 copy and the int64 running count of
    ties were 8 bytes an element of temporaries (an 8B down_proj: 0.7 GB, the streamed prune run's peak)."""
    flat = t.detach().reshape(-1)
    pruned = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
    need = ties
    for i in range(0, flat.numel(), chunk):
        a = flat[i:i + chunk].abs().float()
        torch.lt(a, value, out=pruned[i:i + chunk])
        if need:  # the first ties, in flattened order, from the chunk's own |w|
            at = torch.nonzero(a == value).flatten()[:need]
            pruned[i + at] = True
            need -= at.numel()
    return pruned.view(t.shape)


def smallest_masks(tensors: Sequence[Tensor], k: int, **kwargs: int) -> list[Tensor]:
    """Prune masks (True = pruned) selecting exactly the k smallest |w| over all tensors together."""
    th = global_threshold(tensors, k, **kwargs)
    return [prune_mask(t, th.value, n) for t, n in zip(tensors, th.ties)]
