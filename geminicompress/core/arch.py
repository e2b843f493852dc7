"""Architectures as data: where the decoder layers are, which linears run in which order, which op feeds which.

Found by looking at the model (trace.py: `_no_split_modules` and one traced forward of a copy of layer 0),
cached per model class and config; `OVERRIDES` keeps only what a trace cannot tell, per `model_type`.
Used by every layer-by-layer method:
- `layers`: attribute path from the *CausalLM* to the decoder-layer `ModuleList`.
- `sequential`: the linears of one decoder layer in execution order, grouped so that linears reading
  the same input are together (GPTQ's true-sequential order; SparseGPT and Wanda reuse it).
- `smooth`: AWQ/SmoothQuant groups: an op (`prev`, a norm or a linear) whose output feeds `linears`;
  `inspect` is the module whose output AWQ compares before/after scaling (relative to the layer; "" is
  the layer itself). A group whose shapes do not allow folding (e.g. v_proj -> o_proj under grouped-query
  attention) is skipped at run time by the caller, as llm-awq does.
- `unfed`: groups of linears whose input no norm or linear produces (nothing to fold a scale into: the
  layer's own input in a post-norm block such as OLMo 2's).
- `norm_offset`: 1.0 where the norm multiplies by (1 + weight) (Gemma), else 0.0.
- `final_norm`: path from the CausalLM to the norm applied after the last decoder layer (a layer-streamed
  forward hands its final hidden states to that module: engine/forward.py).
- `output_tuple`: 0 when a decoder layer returns its hidden states, else the length of the tuple it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from geminicompress.core.trace import trace


@dataclass(frozen=True)
class SmoothGroup:
    prev: str
    linears: tuple[str, ...]
    inspect: str


@dataclass(frozen=True)
class Arch:
    layers: str
    sequential: tuple[tuple[str, ...], ...]
    smooth: tuple[SmoothGroup, ...]
    norm_offset: float = 0.0
    final_norm: str = "model.norm"
    unfed: tuple[tuple[str, ...], ...] = ()
    output_tuple: int = 0

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


# What a trace cannot tell, per model_type: {field of Arch: value}. Empty while every tested architecture
# traces right (docs/architectures.md: how a row is added).
OVERRIDES: dict[str, dict[str, Any]] = {}

_TRACED: dict[tuple[type, str], Arch] = {}


def traced_arch(model: nn.Module) -> Arch:
    """The structure the trace finds, before overrides."""
    t = trace(model)
    return Arch(t.layers, t.sequential, tuple(SmoothGroup(p, lin, ins) for p, lin, ins in t.feeds), t.norm_offset,
                t.final_norm, t.unfed, t.output_tuple)


def arch_for(model: nn.Module) -> Arch:
    """The model's structure: traced once per model class and config, with the `OVERRIDES` row applied."""
    key = (type(model), model.config.to_json_string(use_diff=False))
    if key not in _TRACED:
        arch = traced_arch(model)
        _TRACED[key] = dataclasses.replace(arch, **OVERRIDES.get(getattr(model.config, "model_type", ""), {}))
    return _TRACED[key]


def get_module(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split(".") if path else ():
        module = getattr(module, part)
    return module


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = get_module(root, parent_path) if parent_path else root
    setattr(parent, name, new)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return get_module(model, arch_for(model).layers)


def outside_modules(model: nn.Module) -> list[str]:
    """The modules holding parameters (or persistent buffers: an INT8 head) outside the decoder layers
    (embeddings, final norm, head), in model order, each the smallest module that owns them."""
    layers = arch_for(model).layers
    out: list[str] = []
    for name, module in model.named_modules():
        if name == layers or name.startswith(f"{layers}."):
            continue
        buffers = [n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set]
        if buffers or any(True for _ in module.parameters(recurse=False)):
            out.append(name)
    return out


def tied_output(model: nn.Module) -> str | None:
    """The output head's module name when it shares the input embedding's weight (stored once), else None."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    return next(name for name, m in model.named_modules() if m is out)
