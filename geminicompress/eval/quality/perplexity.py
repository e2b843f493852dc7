"""Perplexity with the standard protocol: non-overlapping windows, mean token NLL over all windows.

For a window x_1..x_T the model predicts x_{t+1} from x_{<=t}, so each window contributes T-1 scored
tokens (exactly what `model(x, labels=x).loss` averages). All windows have the same length, so the
mean over all scored tokens equals the mean of the per-window losses, and

    ppl = exp( (1 / N) * sum_windows sum_t -log p(x_{t+1} | x_{<=t}) ),  N = n_windows * (T - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@torch.no_grad()
def window_logprobs(model, window: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Log-probabilities of the next token at every position but the last: (T-1, V) float32 on CPU."""
    ids = window.view(1, -1).to(device)  # (1, T)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # (T-1, V)
    return F.log_softmax(logits.float(), dim=-1).cpu()


def token_nll(logprobs: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """-log p(x_{t+1}) for each scored position: logprobs (T-1, V), window (T,) -> (T-1,)."""
    targets = window[1:].view(-1, 1).to(logprobs.device)
    return -logprobs.gather(-1, targets).squeeze(-1)


@dataclass
class PerplexityMeter:
    """Running sum of token NLLs; `perplexity` is exp of their mean."""

    nll_sum: float = 0.0
    tokens: int = 0
    windows: int = 0

    def add(self, nll: torch.Tensor) -> None:
        self.nll_sum += float(nll.double().sum())
        self.tokens += nll.numel()
        self.windows += 1

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else float("nan")


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over windows (n, T), `batch_size` windows per forward (the same value as
    the per-window meter up to float rounding). Used by training evaluations and the benchmarks."""
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        ids = windows[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (b, T-1, V)
        nll += float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(nll / count)
