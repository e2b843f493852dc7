"""Attention for one query token in bfloat16 on a CPU (a decode step): a plain matmul-softmax in float32 instead
of torch's flash-attention CPU kernel.

For bfloat16 inputs torch's `scaled_dot_product_attention` takes 125 µs a layer for one token against 300 cached
positions on an AMD EPYC, 442 µs against 1,000, where softmax(q·kᵀ)·v in float32 takes 40 and 82
(benchmarks/studies/serving/decode_attention.py, the demo's heads). float32 inputs, and 5 query tokens in either
dtype, are as fast through torch's kernel, so they keep it. In the demo's INT4 copy, which computes in bfloat16
(kernels/int4.py), that kernel was a third of a decode step (4.1 of 12 ms in a profile); the whole step
17.7 → 15.1 ms after 300 cached positions, 28.1 → 16.4 ms after 1,000. On an Intel Xeon the kernel is the faster
(28 µs against 63 at 300 positions, 60 against 126 at 1,000): `use_decode_attention` switches a model on an AMD
CPU only (cpu_vendor.py).

`decode_attention` is registered with transformers as the attention "sdpa-cpu-decode" (with sdpa's mask builder):
a bfloat16 CPU call with one query token per sequence and no dropout is computed here, with the mask transformers
made or none (one token sees the whole cache); every other call goes to transformers' own sdpa function.
`grouped_attention` is the math: the query heads grouped on their KV head (no copy of the cache per head), scores
and softmax in float32, the result rounded once to bfloat16: it agrees with the kernel to bfloat16 rounding (tests/test_decode_attention.py).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from geminicompress.kernels.cpu_vendor import AMD

NAME = "sdpa-cpu-decode"
SHORT_QUERY_MAX = 1  # query tokens it takes (decode_attention.py: 1 token 0.32x the kernel's time, 5 tokens 1.15x)
FASTER_HERE = AMD  # where it beats torch's kernel (cpu_vendor.py); elsewhere use_decode_attention changes nothing


def _short(query: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    n = query.shape[2]
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16 and n <= SHORT_QUERY_MAX and not dropout
            and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "s_aux", "sinks"))
            and (mask is None or mask.dim() == 4 and mask.shape[1] == 1))


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v in float32, the query heads grouped on their KV head (no copy of the cache per
    head): query (B, H, Q, D), key and value (B, KV, L, D), mask None or (B, 1, Q, L) (bool: True attends; float:
    added); returns (B, Q, H, Dv) in the query's dtype."""
    b, h, n, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    groups = h // kv
    q = query.float().reshape(b, kv, groups * n, d)  # query head i reads KV head i // groups
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # (B, KV, groups * Q, L)
    if mask is not None:
        mask = mask[..., :length].unsqueeze(1)  # (B, 1, 1, Q, L)
        scores = scores.view(b, kv, groups, n, length)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        else:
            scores = scores + mask.float()
        scores = scores.view(b, kv, groups * n, length)
    out = torch.matmul(scores.softmax(-1), value.float())  # (B, KV, groups * Q, Dv)
    return out.view(b, h, n, -1).transpose(1, 2).contiguous().to(query.dtype)


def _sdpa_forward():
    """transformers' own sdpa attention function (imported on first use: transformers is slow to import)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, Q, D), key and value (B, KV, L, D); returns (B, Q, H, Dv)."""
    if not _short(query, attention_mask, dropout, kwargs):
        return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return grouped_attention(query, key, value, attention_mask, scale), None


@cache
def _register() -> None:
    """NAME in transformers' attention and mask registries (once, on first use, not when this module is imported:
    importing them costs a command's start-up 2 s)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attention_name(model: nn.Module, wanted: str) -> str:
    """The attention implementation to set on `model` for `wanted`: "sdpa" becomes NAME on a model that
    use_decode_attention marked; anything else is itself."""
    return NAME if wanted == "sdpa" and getattr(model, "_decode_attention", False) else wanted


def use_decode_attention(model: nn.Module) -> bool:
    """Mark `model` (a bfloat16 model on a CPU) and switch its "sdpa" attention to NAME, on a CPU where that is
    faster (FASTER_HERE; elsewhere nothing changes); True if it runs it now."""
    if not FASTER_HERE:
        return False
    _register()  # also for a model on eager now: a serving row may ask it for sdpa later (attention_name)
    model._decode_attention = True
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        try:
            model.set_attn_implementation(NAME)
        except (ValueError, ImportError):  # a model class that takes no registered attention: sdpa as it is
            model._decode_attention = False
    return getattr(model.config, "_attn_implementation", None) == NAME
