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

from geminicompress.models.head import chunk_logits, final_states


@torch.no_grad()
def window_logprobs(model, window: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Log-probabilities of the next token at every position but the last: (T-1, V) float32 on CPU, whole
    (the scoring passes take them in chunks instead: models/head.py's `window_chunks`)."""
    ids = window.view(1, -1).to(device)  # (1, T)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # (T-1, V)
    return F.log_softmax(logits.float(), dim=-1).cpu()


def token_nll(logprobs: torch.Tensor, window: torch.Tensor, start: int = 0) -> torch.Tensor:
    """-log p(x_{t+1}) for each scored position: logprobs (c, V) of positions start..start+c-1 of window (T,)
    (all T-1 of them by default) -> (c,)."""
    targets = window[start + 1 : start + 1 + logprobs.shape[0]].view(-1, 1).to(logprobs.device)
    return -logprobs.gather(-1, targets).squeeze(-1)


@dataclass
class PerplexityMeter:
    """Running sum of token NLLs; `perplexity` is exp of their mean."""

    nll_sum: float = 0.0
    tokens: int = 0
    windows: int = 0

    def add(self, nll: torch.Tensor, window: bool = True) -> None:
        """Add token NLLs; `window=False` for a chunk of a window that is not its first."""
        self.nll_sum += float(nll.double().sum())
        self.tokens += nll.numel()
        self.windows += int(window)

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else float("nan")


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over windows (n, T), `batch_size` windows per decoder forward, the head over
    chunks of positions (models/head.py; the same value as the per-window meter up to float rounding). Used by
    training evaluations, the serving table and the benchmarks."""
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        ids = windows[start : start + batch_size].to(device)
        hidden = final_states(model, ids)[:, :-1].flatten(0, 1)  # (b·(T-1), d)
        targets = ids[:, 1:].flatten()
        for first, logits in chunk_logits(model, hidden):  # (c, V) each
            nll += float(F.cross_entropy(logits, targets[first : first + logits.shape[0]], reduction="sum"))
        count += targets.numel()
    model.train(was_training)
    return math.exp(nll / count)
