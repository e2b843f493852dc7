"""Distillation losses on small tensors with known answers."""

import math

import pytest
import torch

from geminicompress.distill.losses import (
    SparseLogits,
    cross_entropy,
    distill_loss,
    forward_kl,
    hidden_cos,
    hidden_mse,
    jsd,
    reverse_kl,
)
from geminicompress.distill.config import LossWeights


def test_kl_of_identical_logits_is_zero():
    z = torch.randn(2, 5, 11)
    for fn in (forward_kl, reverse_kl, jsd):
        assert fn(z, z.clone(), temperature=2.0).abs() < 1e-6


def test_forward_kl_value_and_gradient_match_hand_computation():
    torch.manual_seed(0)
    s = torch.randn(1, 3, 4, requires_grad=True)  # (B, T, V), N = 3 tokens
    t = torch.randn(1, 3, 4)
    T = 2.0
    loss = forward_kl(s, t, T)
    p = torch.softmax(t / T, -1)
    q = torch.softmax(s.detach() / T, -1)
    by_hand = (p * (p.log() - q.log())).sum(-1).mean() * T**2
    torch.testing.assert_close(loss, by_hand)
    loss.backward()
    # d/dz of T^2 * mean_n KL(p || softmax(z/T)) = T^2 * (q - p) / (T * N) = T * (q - p) / N
    torch.testing.assert_close(s.grad, T * (q - p) / 3)


def test_reverse_kl_and_jsd_by_hand():
    s, t = torch.tensor([[[1.0, 0.0, -1.0]]]), torch.tensor([[[0.0, 0.5, 0.0]]])
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    torch.testing.assert_close(reverse_kl(s, t), (q * (q / p).log()).sum())
    m = (p + q) / 2
    torch.testing.assert_close(jsd(s, t), 0.5 * ((p * (p / m).log()).sum() + (q * (q / m).log()).sum()))
    assert 0 < float(jsd(s, t)) <= math.log(2)


def test_topk_forward_kl_equals_dense_kl_when_k_is_the_vocabulary():
    torch.manual_seed(1)
    s, t = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    top = t.topk(6, -1)
    sparse = SparseLogits(top.values, top.indices)
    for fn in (forward_kl, reverse_kl, jsd):
        torch.testing.assert_close(fn(s, sparse, 1.5), fn(s, t, 1.5))


def test_topk_kl_ignores_the_tail_of_the_teacher():
    s = torch.zeros(1, 1, 4)
    t = torch.tensor([[[5.0, 4.0, -9.0, -9.0]]])
    top = t.topk(2, -1)
    p = torch.softmax(torch.tensor([5.0, 4.0]), -1)  # teacher renormalised on its top 2
    expected = (p * (p.log() - math.log(0.25))).sum()
    torch.testing.assert_close(forward_kl(s, SparseLogits(top.values, top.indices)), expected)


def test_cross_entropy_shifts_by_one():
    ids = torch.tensor([[0, 2, 1]])
    logits = torch.full((1, 3, 3), -1e4)
    logits[0, 0, 2] = logits[0, 1, 1] = 0.0  # predicts the next ids exactly
    assert float(cross_entropy(logits, ids)) < 1e-6


def test_hidden_losses():
    h = torch.randn(2, 3, 8)
    assert float(hidden_mse(h, h)) == 0.0
    assert float(hidden_cos(2 * h, h)) < 1e-6
    torch.testing.assert_close(hidden_mse(torch.zeros_like(h), h), torch.tensor(1.0))


def test_weighted_sum_and_layer_map():
    ids = torch.randint(0, 5, (1, 4))
    s, t = torch.randn(1, 4, 5), torch.randn(1, 4, 5)
    hs = tuple(torch.randn(1, 4, 3) for _ in range(3))  # embeddings + 2 layers
    ht = tuple(torch.randn(1, 4, 3) for _ in range(5))  # embeddings + 4 layers
    w = LossWeights(kl=0.5, ce=2.0, hidden_mse=1.0)
    total, terms = distill_loss(w, 2.0, ids, s, t, hs, ht, {0: 1, 1: 3})
    assert set(terms) == {"kl", "ce", "hidden_mse"}
    mse = (hidden_mse(hs[1], ht[2]) + hidden_mse(hs[2], ht[4])) / 2
    torch.testing.assert_close(terms["hidden_mse"], float(mse), rtol=1e-5, atol=1e-6)
    expected = 0.5 * forward_kl(s, t, 2.0) + 2.0 * cross_entropy(s, ids) + mse
    torch.testing.assert_close(total, expected)


def test_loss_weights_need_one_positive():
    with pytest.raises(ValueError, match="at least one loss weight"):
        LossWeights(kl=0.0, ce=0.0)


def test_the_default_loss_is_kl_at_temperature_1_plus_half_the_data_cross_entropy():
    """The defaults (docs/distill.md, Losses): a weight not named keeps its default, so KL alone is kl=1,ce=0."""
    from geminicompress.distill.config import DistillStage

    assert LossWeights().model_dump() == {"kl": 1.0, "reverse_kl": 0.0, "jsd": 0.0, "ce": 0.5, "hidden_mse": 0.0,
                                          "hidden_cos": 0.0}
    assert LossWeights(kl=2.0).ce == 0.5 and LossWeights(ce=0.0).kl == 1.0
    assert DistillStage(type="distill").temperature == 1.0
    ids = torch.randint(0, 5, (1, 4))
    s, t = torch.randn(1, 4, 5), torch.randn(1, 4, 5)
    total, terms = distill_loss(LossWeights(), 1.0, ids, s, t, None, None, None)
    assert set(terms) == {"kl", "ce"}
    torch.testing.assert_close(total, forward_kl(s, t, 1.0) + 0.5 * cross_entropy(s, ids))
