"""Text -> token ids -> fixed-length windows. The one place where tokenization, framing and sampling happen.

A window is framed the way the model's tokenizer frames a text (`text_prefix`): the tokenizer's own prefix
tokens first (the BOS that Gemma, Llama 3 and Mistral put before every text; nothing for SmolLM2 or Qwen),
then `seq_len - len(prefix)` text tokens. Position 0 is never a scored target, so a one-token prefix is
never scored; without BOS a model's first text token becomes its attention sink, and a model that always
sees BOS in use reads a text-led window very differently (Gemma 3 270M: perplexity 69.6 text-led, 24.4
BOS-led). `frame="text"` gives windows of text tokens only, for text that is not a document start.

- `pack_windows`: non-overlapping consecutive windows (perplexity protocol, training data).
- `sample_windows`: windows at seeded random offsets (GPTQ/AWQ/SmoothQuant/Wanda calibration),
  drawn with a private `torch.Generator` so the global RNG is untouched and results are reproducible.
"""

from __future__ import annotations

from typing import Sequence

import torch

from geminicompress.core.framing import FRAMES, Frame, prefix_note, text_prefix, vocab_of  # noqa: F401
from geminicompress.data.sources import read_text
from geminicompress.core.errors import InputError


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of the whole text, shape (N,), without special tokens (the text is one stream); the
    prefix a window starts with comes from `text_prefix`."""
    if max_tokens is not None:
        # Avoid tokenizing megabytes when only a prefix is needed: ~4 chars/token, with margin.
        text = text[: max(max_tokens * 12, 1000)]
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)[:max_tokens]  # [:None]: every token


def _with_prefix(body: torch.Tensor, prefix: Sequence[int]) -> torch.Tensor:
    if not prefix:
        return body
    head = torch.tensor(list(prefix), dtype=body.dtype).expand(body.shape[0], len(prefix))
    return torch.cat([head, body], dim=1)


def _body_len(seq_len: int, prefix: Sequence[int]) -> int:
    if seq_len < 1:
        raise InputError(f"sequence length must be positive, got {seq_len}")
    if seq_len <= len(prefix):
        raise InputError(f"a window of {seq_len} tokens holds no text after the tokenizer's {len(prefix)}-token "
                         "prefix; use a longer window")
    return seq_len - len(prefix)


def pack_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None,
                 prefix: Sequence[int] = ()) -> torch.Tensor:
    """Non-overlapping windows of consecutive text, each `prefix` + seq_len - len(prefix) text tokens,
    shape (n, seq_len); the incomplete tail is dropped."""
    body = _body_len(seq_len, prefix)
    n = ids.numel() // body
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    return _with_prefix(ids[: n * body].view(n, body), prefix)


def sample_windows(ids: torch.Tensor, n: int, seq_len: int, seed: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """n windows at seeded random offsets, each `prefix` + seq_len - len(prefix) text tokens, shape (n, seq_len)."""
    body = _body_len(seq_len, prefix)
    if ids.numel() < body + 1:
        raise InputError(f"calibration text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - body, (n,), generator=gen)
    return _with_prefix(torch.stack([ids[s : s + body] for s in starts.tolist()]), prefix)


def calibration_windows(
    tokenizer, spec: str, n: int, seq_len: int, seed: int, text_column: str = "text", frame: Frame = "tokenizer",
    vocab: int | None = None,
) -> torch.Tensor:
    """Read DATA, tokenize, and draw the calibration windows, framed as the tokenizer frames a text:
    (n, seq_len) token ids. `vocab`: the model's vocabulary size, which every prefix id must be below."""
    prefix = text_prefix(tokenizer, frame, vocab)
    ids = tokenize(tokenizer, read_text(spec, text_column))
    return sample_windows(ids, n, seq_len, seed, prefix)
