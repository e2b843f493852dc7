"""The big modules outside the layers (output head, input embeddings) computed in float32 from their weights as
stored, without a float32 copy of the whole weight.

The streamed paths run the embeddings, final norm and head in float32: the check of OUT (the probe's side and
OUT read back one layer at a time), layer 0's inputs of a streamed walk, a streamed distill teacher's top-k.
Reading those weights in float32 made a float32 copy of each: with a 262,144-token vocabulary at hidden 5,376
(Gemma 3 27B) that is 5.6 GB a copy, more than any decoder layer and the peak of the whole streamed run.

- `Float32Rows` holds a linear's weight as stored (bfloat16: half that) and converts `BLOCK_BYTES` of its rows
  to float32 at a time. Each logit is the same float32 dot product as the float32 linear's (only the output
  columns are blocked).
- `Float32Gather` runs an embedding module's own forward (Gemma's scaled embedding multiplies in its weight's
  dtype) on a float32 copy of just the rows the ids use, the ids renumbered into it: the float32 module's
  output exactly, since a lookup copies rows.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.core.rows import BLOCK_BYTES, rows_within, spans


class Float32Rows(nn.Module):
    """`linear` (weights in a lower-precision float dtype) computed as its float32 copy would be, without it."""

    def __init__(self, linear: nn.Linear, block_bytes: int | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.rows = rows_within(linear.in_features, block_bytes or BLOCK_BYTES)  # float32 rows of in_features each

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight, self.linear.bias
        x = x.float()
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for start, stop in spans(weight.shape[0], self.rows):
            out[..., start:stop] = F.linear(x, weight[start:stop].float(),
                                            None if bias is None else bias[start:stop].float())
        return out


class Float32Gather(nn.Module):
    """`embedding` (an nn.Embedding or a subclass, weights in a lower-precision float dtype) computed as its
    float32 copy would be, from a float32 copy of the rows looked up."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        module = self.embedding
        stored, padding = module.weight, module.padding_idx
        used, local = ids.unique(return_inverse=True)
        module.weight = nn.Parameter(stored[used].float(), requires_grad=False)
        module.padding_idx = None  # only the gradient reads it; an index into the full table would be out of range
        try:
            return module(local.view_as(ids), *args, **kwargs)
        finally:
            module.weight, module.padding_idx = stored, padding
