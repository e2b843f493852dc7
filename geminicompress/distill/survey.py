"""The calibration walk a cut is chosen from (plan.py) and repaired on (repair.py).

Calibration windows go through the teacher one decoder layer at a time (every window through layer 0,
then every window through layer 1, ...), and the walk keeps:
- the residual stream at every layer boundary, h_0 (layer 0's input) .. h_L (the last layer's output,
  before the final norm): what a student that skips blocks i..i+n-1 must reproduce at boundary i+n;
- Minitron activation importance (Muralidharan et al. 2024, "Compact Language Models via Pruning and
  Knowledge Distillation"): per MLP channel the mean |activation| entering the down projection, per
  attention head the mean L2 norm of its output entering the output projection.

Angular distance of a span (Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers"):
d(h_i, h_{i+n}) = arccos(cos(h_i, h_{i+n})) / pi, averaged over tokens; a small distance says the span
changes the residual stream little. The measured drift of a cut (plan.py) is the better signal: the
perplexity of the held-out windows when the student skips the span, from `run_layers` and `mean_nll`.

Memory: (L + 1) * n * T * d float32 values for the boundaries (the demo, 36 windows of 512: 1.3 GB), held
while the candidates are scored; once the repairs left to run are known, the boundaries they do not read are
released (`Walk.keep_only`, repair.boundaries_read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.core.arch import arch_for, decoder_layers
from geminicompress.engine.forward import embed, head_logits
from geminicompress.engine.layers import layer_output
from geminicompress.core.errors import InputError
from geminicompress.host.memory import available_memory
from geminicompress.host.progress import NullProgress, Progress


def walk_bytes(model: nn.Module, n: int, seq_len: int) -> int:
    """Bytes the walk's boundaries take: (L + 1) * n * T * d float32 values."""
    config = model.config
    return (config.num_hidden_layers + 1) * n * seq_len * config.hidden_size * 4


def check_walk_memory(model: nn.Module, n: int, seq_len: int) -> None:
    """Refuse, before any work, a walk whose boundaries alone would not fit in the memory available now."""
    need, have = walk_bytes(model, n, seq_len), available_memory()
    if have and need > have:
        raise InputError(f"the cut's calibration walk would hold {need / 2**20:,.0f} MiB of hidden states ("
                         f"{model.config.num_hidden_layers + 1} boundaries x {n} windows x {seq_len} tokens x "
                         f"{model.config.hidden_size} float32) and {have / 2**20:,.0f} MiB are available: lower "
                         "repair_windows, repair_synthetic or plan_held_windows")


@dataclass(frozen=True)
class Compute:
    """Where the walk's replays run: the device, windows per forward, and the progress they report to."""

    device: torch.device = torch.device("cpu")
    batch: int = 4
    progress: Progress | None = None


@dataclass
class Walk:
    """The teacher's residual stream on calibration windows and its activation importance."""

    hidden: list[torch.Tensor | None]  # L + 1 boundaries, (n, T, d) float32 on CPU each (None: released)
    kwargs: dict[str, Any]  # what the model passes its decoder layers (rotary embeddings, mask)
    channels: torch.Tensor | None = None  # (L, I) mean |activation| of each MLP channel
    heads: torch.Tensor | None = None  # (L, heads) mean L2 norm of each attention head's output

    @property
    def n_layers(self) -> int:
        return len(self.hidden) - 1

    def rows(self, start: int, stop: int) -> "Walk":
        """The walk of windows start..stop-1 (views, no copy)."""
        return Walk([h[start:stop] for h in self.hidden], self.kwargs, self.channels, self.heads)

    def split(self, at: int) -> tuple["Walk", "Walk"]:
        """(windows ..at-1, windows at..): the first views of this walk, the second a copy, so that dropping
        this walk and boundaries of the first (`keep_only`) frees them whatever the second still holds."""
        held = self.rows(at, self.hidden[0].shape[0])
        return self.rows(0, at), Walk([h.clone() for h in held.hidden], self.kwargs, self.channels, self.heads)

    def keep_only(self, boundaries: set[int]) -> None:
        """Release every boundary but `boundaries` (None in its place): what is left to read of the walk."""
        self.hidden = [h if i in boundaries else None for i, h in enumerate(self.hidden)]


def mlp_down(model: nn.Module) -> str:
    """The name, inside a decoder layer, of the linear that writes the MLP's output into the residual stream."""
    return arch_for(model).sequential[-1][0]


def attn_out(model: nn.Module) -> str:
    """The name, inside a decoder layer, of the attention's output projection."""
    return arch_for(model).sequential[1][0]


@torch.no_grad()
def walk(model: nn.Module, windows: torch.Tensor, *, device: torch.device, batch: int = 4,
         progress: Progress | None = None) -> Walk:
    """Run windows (n, T) through every decoder layer of `model` (in memory), keeping every boundary and
    the activation importance of MLP channels and attention heads."""
    progress = progress or NullProgress()
    layers = decoder_layers(model)
    first = embed(model, windows, device=device)
    hidden, layer_kwargs = [first.tensor], first.layer_kwargs  # what the model hands each layer
    down, o_proj = mlp_down(model), attn_out(model)
    n_heads = model.config.num_attention_heads
    channels, heads = [], []
    with progress.task("survey", len(layers)) as bar:
        for i, layer in enumerate(layers):
            sums = {"down": 0.0, "heads": 0.0, "tokens": 0}

            def see_down(m, args, sums=sums):
                a = args[0].detach().float()  # (b, T, I)
                sums["down"] = sums["down"] + a.abs().sum(dim=(0, 1)).cpu().double()
                sums["tokens"] += a.shape[0] * a.shape[1]

            def see_heads(m, args, sums=sums):
                a = args[0].detach().float()  # (b, T, heads * head_dim)
                per_head = a.unflatten(-1, (n_heads, -1)).norm(dim=-1)  # (b, T, heads)
                sums["heads"] = sums["heads"] + per_head.sum(dim=(0, 1)).cpu().double()

            handles = [layer.get_submodule(down).register_forward_pre_hook(see_down),
                       layer.get_submodule(o_proj).register_forward_pre_hook(see_heads)]
            try:
                layer.to(device)
                hidden.append(run_layers([layer], hidden[-1], layer_kwargs[i], device=device, batch=batch))
            finally:
                for h in handles:
                    h.remove()
            channels.append(sums["down"] / max(1, sums["tokens"]))
            heads.append(sums["heads"] / max(1, sums["tokens"]))
            bar.advance(1)
    # the repair replays the kept layers with the first layer's arguments: exact for models whose layers all
    # attend alike (Llama, Qwen, Mistral); Gemma 2/3's sliding layers would need theirs (not handled yet)
    return Walk(hidden, layer_kwargs[0], torch.stack(channels).float(), torch.stack(heads).float())


@torch.no_grad()
def run_layers(layers: Sequence[nn.Module], h: torch.Tensor, kwargs: dict[str, Any], *, device: torch.device,
               batch: int = 4) -> torch.Tensor:
    """h (n, T, d) through `layers` in order, `batch` windows at a time; returns a new (n, T, d) on CPU."""
    out = torch.empty_like(h, device="cpu")
    for b in range(0, h.shape[0], batch):
        x = h[b:b + batch].to(device)
        for layer in layers:
            x = layer_output(layer, x, kwargs)
        out[b:b + batch].copy_(x)
    return out


class _Hidden:
    """What `head_logits` reads of final hidden states: `.tensor` (n, T, d)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@torch.no_grad()
def mean_nll(model: nn.Module, final: torch.Tensor, windows: torch.Tensor, *, device: torch.device) -> float:
    """Mean next-token NLL of windows (n, T) from their final hidden states (n, T, d) (before the final
    norm), through the model's own final norm and head: the `perplexity()` protocol (exp of it)."""
    nll, count = 0.0, 0
    for b, logits in head_logits(model, _Hidden(final), device=device):  # logits: (1, T, V)
        ids = windows[b:b + logits.shape[0]].to(logits.device)
        nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        count += ids[:, 1:].numel()
    return nll / count


def angular_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of arccos(cos(a, b)) / pi; a, b: (..., d)."""
    cos = F.cosine_similarity(a.flatten(0, -2).double(), b.flatten(0, -2).double(), dim=-1).clamp(-1.0, 1.0)
    return float(torch.arccos(cos).mean() / math.pi)


def span_distances(w: Walk, n: int) -> list[float]:
    """Angular distance of every span of n blocks: entry i is d(h_i, h_{i+n}), i = 0..L-n."""
    return [angular_distance(w.hidden[i], w.hidden[i + n]) for i in range(w.n_layers - n + 1)]
