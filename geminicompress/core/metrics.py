"""Drift of a model's next-token distribution from the baseline's, on the same windows.

Per scored token, with p = baseline and q = model next-token distributions:

    KL(p || q) = sum_v p_v (log p_v - log q_v)      (nats; 0 when the model equals the baseline)
    agree      = [argmax_v p_v == argmax_v q_v]      (greedy decoding would pick the same token)

Both are averaged over all scored tokens. The perplexity ratio is ppl(model) / ppl(baseline).
Pure tensor math: callers stream windows through `DriftMeter.add` so no logits are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kl_per_token(base_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(baseline || model) per position: log-probs (N, V) each -> (N,) in nats."""
    p = base_logp.exp()
    terms = (base_logp - logp).mul_(p)  # in place: two (N, V) temporaries, not five (a chunk's are 32 MB each)
    return terms.masked_fill_(~(p > 0), 0).sum(-1)  # 0 * log 0 := 0


def top1_agreement(base_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Whether both pick the same most likely token: (N, V) each -> (N,) bool."""
    return base_logp.argmax(-1) == logp.argmax(-1)


@dataclass
class DriftMeter:
    """Running means of KL(baseline || model) and top-1 agreement over scored tokens."""

    kl_sum: float = 0.0
    agree: int = 0
    tokens: int = 0

    def add(self, base_logp: torch.Tensor, logp: torch.Tensor) -> None:
        self.kl_sum += float(kl_per_token(base_logp, logp).double().sum())
        self.agree += int(top1_agreement(base_logp, logp).sum())
        self.tokens += base_logp.shape[0]

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else float("nan")

    @property
    def agreement(self) -> float:
        return self.agree / self.tokens if self.tokens else float("nan")
