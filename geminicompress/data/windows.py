"""Text -> token ids -> fixed-length windows. The one place where tokenization and sampling happen.

- `pack_windows`: non-overlapping consecutive windows (perplexity protocol, training data).
- `sample_windows`: windows at seeded random offsets (GPTQ/AWQ/SmoothQuant/Wanda calibration),
  drawn with a private `torch.Generator` so the global RNG is untouched and results are reproducible.
"""

from __future__ import annotations

import torch

from geminicompress.data.sources import read_text
from geminicompress.errors import InputError


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of the whole text, shape (N,), without special tokens (the text is one stream)."""
    if max_tokens is not None:
        # Avoid tokenizing megabytes when only a prefix is needed: ~4 chars/token, with margin.
        text = text[: max(max_tokens * 12, 1000)]
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)[:max_tokens]  # [:None]: every token


def pack_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows, shape (n, seq_len); the incomplete tail is dropped."""
    if seq_len < 1:
        raise InputError(f"sequence length must be positive, got {seq_len}")
    n = ids.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def sample_windows(ids: torch.Tensor, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """n windows of seq_len tokens at seeded random offsets, shape (n, seq_len)."""
    if ids.numel() < seq_len + 1:
        raise InputError(f"calibration text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def calibration_windows(
    tokenizer, spec: str, n: int, seq_len: int, seed: int, text_column: str = "text"
) -> torch.Tensor:
    """Read DATA, tokenize, and draw the calibration windows: (n, seq_len) token ids."""
    ids = tokenize(tokenizer, read_text(spec, text_column))
    return sample_windows(ids, n, seq_len, seed)
