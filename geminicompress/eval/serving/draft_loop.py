"""Greedy speculative decoding in one small loop (Leviathan et al., 2023; Chen et al., 2023), without `generate`.

Each round the draft proposes `k` tokens greedily from its own KV cache, and the served model reads the last
accepted token and the `k` proposals in one forward: the longest prefix of proposals equal to the model's own
greedy choices is kept, then the model's own next token (the correction, or a bonus token when all `k` agree).
Both KV caches are cropped back to what was kept. The answer is the model's greedy answer (up to float ties
between its k + 1-token forward and a one-token step); the draft only changes how many forwards it takes.

transformers' assisted generation does the same through `generate()`, whose per-call setup (logits processors,
stopping criteria, the assistant's own `generate` every round) costs as much as a decode step of a small model
on a CPU; here a round is `k` draft forwards and one model forward, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from geminicompress.eval.cost.latency import cache_of, forward_args


@dataclass
class DraftCounts:
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of them, equal to the model's greedy choice
    rounds: int = 0  # verification forwards of the model

    def add(self, other: "DraftCounts") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.rounds += other.rounds


class _Stream:
    """One model's forward with its KV cache over a growing sequence: `feed` runs the tokens the cache has not
    seen and returns their logits' greedy choices; `crop` forgets everything after a length."""

    def __init__(self, model, device: torch.device, rollback: int):
        self.model, self.device, self.cache, self.seen, self.rollback = model, device, None, 0, rollback
        self.cache_arg, self.last_only = forward_args(model)  # last_only: `logits_to_keep=1` where supported

    def feed(self, tokens: list[int], every: bool = False) -> list[int]:
        """The greedy choice after each of `tokens` (`every`), or after the last one only (a prefill: the head
        runs on one position, as hf.py's prefill and `generate` do)."""
        ids = torch.tensor([tokens], device=self.device)
        kwargs = {self.cache_arg: self.cache} if self.cache is not None else {}
        out = self.model(input_ids=ids, use_cache=True, **kwargs, **({} if every else self.last_only))
        if self.cache is None and hasattr(cache_of(out), "activate_past_recording"):
            # after the prefill (as generate does): a sliding-window layer keeps what a crop may need back
            cache_of(out).activate_past_recording(recurrent_states_to_keep=self.rollback)
        self.cache, self.seen = cache_of(out), self.seen + len(tokens)
        return out.logits[0].argmax(-1).tolist()

    def crop(self, length: int) -> None:
        if self.seen > length:
            self.cache.crop(length - self.seen)  # transformers >= 5: minus the tokens to remove
            self.seen = length


@torch.no_grad()
def speculative_greedy(model, draft, prompt: list[int], n: int, k: int,
                       on_first: Callable[[], None] | None = None) -> tuple[list[int], DraftCounts]:
    """`n` greedy tokens of `model` after `prompt`, `draft` proposing `k` a round; (tokens, counts).
    `on_first` is called when the first token is out: after both prefills (the model's and the draft's)."""
    if k < 1 or n < 1:
        raise ValueError(f"k and n must be at least 1, got k={k}, n={n}")
    device = next(model.parameters()).device
    verifier, proposer, counts = _Stream(model, device, k + 1), _Stream(draft, device, k + 1), DraftCounts()
    seq = list(prompt)
    seq.append(verifier.feed(seq)[-1])
    proposer.feed(seq[:-1])  # the draft's prefill belongs to the prefill, as in vLLM's step: before the first token
    if on_first is not None:
        on_first()
    while len(seq) - len(prompt) < n:
        want = min(k, n - (len(seq) - len(prompt)) - 1)  # the round also adds the model's own token
        proposals = _propose(proposer, seq, want) if want > 0 else []
        choices = verifier.feed([seq[-1], *proposals], every=True)  # the model's next token after each of them
        m = 0
        while m < len(proposals) and proposals[m] == choices[m]:
            m += 1
        seq.extend([*proposals[:m], choices[m]])
        verifier.crop(len(seq) - 1)  # the last token is fed next round
        proposer.crop(len(seq) - 1)
        counts.add(DraftCounts(len(proposals), m, 1))
    return seq[len(prompt):len(prompt) + n], counts


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens of `model` after `prompt`, one forward a token over the same KV cache as
    speculative_greedy's: the model alone, in the same loop (what a speculative run is compared with)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got n={n}")
    stream = _Stream(model, next(model.parameters()).device, 1)
    seq = list(prompt)
    seq.append(stream.feed(seq)[-1])
    while len(seq) - len(prompt) < n:
        seq.append(stream.feed(seq[-1:])[-1])
    return seq[len(prompt):]


def _propose(proposer: _Stream, seq: list[int], k: int) -> list[int]:
    """`k` greedy draft tokens after `seq` (the draft's cache holds a prefix of it)."""
    proposals = [proposer.feed(seq[proposer.seen:])[-1]]
    while len(proposals) < k:
        proposals.append(proposer.feed(proposals[-1:])[-1])
    return proposals
