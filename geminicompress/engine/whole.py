"""What a method run on a whole model in memory leaves for OUT (a model without decoder layers:
runtime/whole_model.py): the exception to "the decoder layer is the unit of work" (STYLE 14), where there is
no layer to be the unit. Each method's own pass (`Method.whole_model`) returns a `Written`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress.core.arch import tied_output
from geminicompress.formats.checkpoint import module_tensors


class Written:
    """What OUT holds of a compressed model: its tensors (made when asked, the model's own otherwise), the
    format's quantization_config, the weights held as exact codes (left unrounded in the check)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, fmt: str, qconfig: dict[str, Any] | None,
                 summary: dict[str, Any], replace: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 exact: list[str] = (), extra: Callable[[Path, dict], None] | None = None) -> None:
        self.model, self.dtype, self.format, self.qconfig, self.summary = model, dtype, fmt, qconfig, summary
        self.replace, self.exact, self.extra = replace, list(exact), extra

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = module_tensors("", self.model, self.dtype)
        tied = tied_head(self.model)
        if tied is not None:  # stored once, as save_pretrained does: the loader ties it again
            tensors.pop(f"{tied}.weight", None)
        return self.replace(tensors)


def tied_head(model: nn.Module) -> str | None:
    """The output head tied to the input embeddings (None also for a model that does not say which its
    embeddings are: transformers' `get_input_embeddings` raises NotImplementedError then)."""
    try:
        return tied_output(model)
    except NotImplementedError:
        return None
