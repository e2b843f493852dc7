"""A latency target (`--target-latency 0.8x`) as a layer count, from the teacher's parameter share.

Decoding one token on a CPU (and on a GPU at batch 1) is bound by reading the weights: every decoder
block's and the output head's (vocab x hidden); the input embedding reads one row. So a student keeping
k of the teacher's L blocks costs, per token, about

    (head + k * block) / (head + L * block)

of the teacher's time, with block the mean parameter count of a decoder block. `keep_for_latency` is the
largest k within the target. It is computed from parameter shares, not from timed decode: decode time
per layer cannot be measured on a busy shared machine, and the choice must be made from config.json
alone (the skeleton on the meta device) so that an impossible target is refused before any weight loads.
The achieved ratio is measured afterwards (plan.json's `decode`, `eval`'s TPOT).
"""

from __future__ import annotations

import math

import torch.nn as nn

from geminicompress.core.arch import decoder_layers
from geminicompress.core.errors import InputError


def read_shares(model: nn.Module) -> tuple[int, float, int]:
    """(head parameters, mean parameters of a decoder block, number of blocks) read per decoded token."""
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    head = model.get_output_embeddings()
    return sum(p.numel() for p in head.parameters()) if head is not None else 0, sum(blocks) / len(blocks), len(blocks)


def keep_for_latency(model: nn.Module, target: float) -> tuple[int, float]:
    """The most blocks a student may keep to decode in at most `target` of the teacher's time (module
    docstring) and the predicted ratio; an impossible target is refused in one line."""
    head, block, n_layers = read_shares(model)
    ratio = lambda k: (head + k * block) / (head + n_layers * block)  # noqa: E731
    keep = math.floor((target * (head + n_layers * block) - head) / block + 1e-9)
    if keep < 1:
        raise InputError(f"--target-latency {target:g}x: even a 1-layer student reads {ratio(1):.2f}x of the teacher's "
                         f"weights per token (the output head alone is {ratio(0):.2f}x); ask for at least "
                         f"{math.ceil(ratio(1) * 100) / 100:.2f}x")
    keep = min(keep, n_layers - 1)
    return keep, round(ratio(keep), 4)
