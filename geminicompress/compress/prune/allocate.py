"""Non-uniform sparsity: how many weights each prunable linear loses, for one total over all of them.

Allocations (the `allocation` key of a prune stage):
- uniform: the same sparsity in every linear;
- global: one |w| threshold over all linears (magnitude only; `threshold.py`), whatever that gives each;
- owl: Outlier Weighed Layerwise sparsity (Yin et al., 2024, "Outlier Weighed Layerwise Sparsity (OWL):
  A Missing Secret Sauce for Pruning LLMs to High Sparsity", §3). Per decoder layer l, the layerwise
  outlier distribution D_l = the fraction of the layer's Wanda scores |W_ij|·‖X_j‖ above M times their
  mean; layers with more outliers are pruned less: s_l = S − λ + 2λ·(D_max − D_l)/(D_max − D_min)
  shifted so that the mean over layers (weighted by their weights: the total) is exactly S;
- sensitivity: a knapsack over a measured sensitivity table (sensitivity.py), per linear.
Every map is then turned into whole weight counts whose sum is exactly round(S · total) (`exact_counts`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from geminicompress.core.errors import InputError


def outlier_ratio(scores: list[torch.Tensor], m: float) -> float:
    """D_l: the fraction of scores above m × their mean, over every linear of one layer together."""
    total = sum(float(s.double().sum()) for s in scores)
    count = sum(s.numel() for s in scores)
    threshold = m * total / count
    return sum(int((s > threshold).sum()) for s in scores) / count


def owl_layer_sparsity(ratios: list[float], params: list[int], target: float, lam: float) -> list[float]:
    """Per-layer sparsity in [S − λ, S + λ] (before the shift), most outliers → least sparsity, with
    the parameter-weighted mean exactly `target`. Layers with equal ratios all get `target`."""
    d = np.asarray(ratios, dtype=np.float64)
    n = np.asarray(params, dtype=np.float64)
    spread = d.max() - d.min()
    raw = np.zeros_like(d) if spread == 0 else 2 * lam * (d.max() - d) / spread - lam  # in [−λ, λ]
    s = target + raw - float((raw * n).sum() / n.sum())
    if s.min() < 0 or s.max() >= 1:
        raise InputError(f"OWL with lambda {lam:g} around sparsity {target:g} gives a layer sparsity of "
                         f"{s.min():.3f}..{s.max():.3f}, outside [0, 1); lower owl_lambda")
    return [float(v) for v in s]


def exact_counts(params: dict[str, int], sparsity: dict[str, float], target: float) -> dict[str, int]:
    """Whole numbers of weights to prune per linear, near `sparsity[name] · params[name]`, summing to
    exactly round(target · Σ params): the rounding remainders go to the largest fractional parts, and a
    map whose weighted mean is off the target is first scaled onto it."""
    total = sum(params.values())
    want = round(target * total)
    raw = {k: sparsity[k] * params[k] for k in params}
    have = sum(raw.values())
    if have > 0 and abs(have - want) > 0.5:
        raw = {k: min(params[k], v * want / have) for k, v in raw.items()}
    counts = {k: min(params[k], math.floor(v)) for k, v in raw.items()}
    left = want - sum(counts.values())
    order = sorted(params, key=lambda k: (raw[k] - counts[k], params[k]), reverse=True)
    while left > 0:  # (a module capped at all its weights takes none: loop over the others)
        progressed = False
        for k in order:
            if left and counts[k] < params[k]:
                counts[k] += 1
                left -= 1
                progressed = True
        assert progressed, "the target cannot exceed the prunable weights"
    while left < 0:
        for k in order[::-1]:
            if left and counts[k] > 0:
                counts[k] -= 1
                left += 1
    return counts
