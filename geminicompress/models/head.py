"""The output head over chunks of positions, so that a window's logits are never held whole.

A window of T tokens through a model with a vocabulary of V has (T, V) logits: 2.1 GB in float32 for
Gemma 3 (V = 262,144) at T = 2,048, and every log-softmax, KL or top-k over them makes another such
tensor. Everything that scores positions (eval's perplexity, KL and top-1, sensitivity's KL, distill's
top-k cache, the serving table's perplexity) runs the decoder once per window for its final hidden
states, (T, d), and then the head over `chunk_rows(V)` positions at a time: memory follows one chunk's
(rows, V), not the window's.

The head is the model's *own*: its CausalLM forward runs with the decoder swapped for a stub that hands
it the chunk's hidden states, so whatever the model does after its decoder (the output projection,
Gemma's logit soft-capping, a logit scale) is what transformers does. The figures are the unchunked
ones up to the float rounding of a matrix product over fewer rows (tests/test_eval_chunks.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPast

from geminicompress.core.rows import rows_within, spans
from geminicompress.host.memory import heap_reuse

CHUNK_BYTES = 32 * 2**20  # one chunk's float32 (rows, V) logits: each of the few temporaries per chunk


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that a chunk's float32 logits (rows, vocab) take at most `budget` bytes."""
    return rows_within(vocab, budget)


def decoder_of(model: nn.Module) -> nn.Module:
    """The CausalLM's decoder (its base model: embeddings, layers, final norm)."""
    return getattr(model, model.base_model_prefix)


@torch.no_grad()
def final_states(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's output for ids (b, T): (b, T, d), after the final norm (what the head reads)."""
    return decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state


class _Stub(nn.Module):
    """Stands in for the decoder: returns the hidden states it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> BaseModelOutputWithPast:
        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


@contextmanager
def own_head(model: nn.Module) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Yields head(hidden (b, c, d)) -> logits (b, c, V) through the model's own forward (its decoder swapped
    for a stub meanwhile, put back on exit)."""
    prefix = model.base_model_prefix
    decoder, stub = getattr(model, prefix), _Stub()
    device = next(decoder.parameters()).device

    def head(hidden: torch.Tensor) -> torch.Tensor:
        stub.hidden = hidden
        dummy = torch.zeros(hidden.shape[:2], dtype=torch.long, device=device)  # never read: the stub ignores it
        return model(input_ids=dummy, use_cache=False).logits

    setattr(model, prefix, stub)
    try:
        yield head
    finally:
        setattr(model, prefix, decoder)


@torch.no_grad()
def chunk_logits(model: nn.Module, hidden: torch.Tensor, rows: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, float32 logits (c, V)) of the final hidden states (N, d), through the model's own head, `rows`
    positions (default chunk_rows(V)) at a time. The decoder is swapped only while a chunk is computed, so
    the model may run whole between chunks."""
    for start, stop in spans(hidden.shape[0], rows or chunk_rows(model.config.vocab_size)):
        with own_head(model) as head:
            logits = head(hidden[start:stop].unsqueeze(0))[0]
        yield start, logits.float()


@torch.no_grad()
def window_chunks(model: nn.Module, window: torch.Tensor, device: torch.device,
                  rows: int | None = None) -> Iterator[torch.Tensor]:
    """Log-probabilities of the next token at every position but the last of window (T,), as consecutive
    chunks (c, V) float32 on the CPU: `perplexity.window_logprobs` without ever holding (T-1, V)."""
    with heap_reuse():  # the decoder's activation buffers reused across its layers, not faulted in each time
        hidden = final_states(model, window.view(1, -1).to(device))[0, :-1]  # (T-1, d)
    for _, logits in chunk_logits(model, hidden, rows):
        yield F.log_softmax(logits, dim=-1).cpu()
