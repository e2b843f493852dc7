"""Architectures as data: where the decoder layers are, which linears run in which order, which op feeds which.

One `Arch` per `model_type`. Used by every layer-by-layer method:
- `layers`: attribute path from the *CausalLM* to the decoder-layer `ModuleList`.
- `sequential`: the linears of one decoder layer in execution order, grouped so that linears reading
  the same input are together (GPTQ's true-sequential order; SparseGPT and Wanda reuse it).
- `smooth`: AWQ/SmoothQuant groups: an op (`prev`, a norm or a linear) whose output feeds `linears`;
  `inspect` is the module whose output AWQ compares before/after scaling (relative to the layer).
  A group whose shapes do not allow folding (e.g. v_proj -> o_proj under grouped-query attention)
  is skipped at run time by the caller, as llm-awq does.
- `norm_offset`: 1.0 where the norm multiplies by (1 + weight) (Gemma), else 0.0.
- `final_norm`: path from the CausalLM to the norm applied after the last decoder layer (a layer-streamed
  forward hands its final hidden states to that module: engine/forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from geminicompress.errors import InputError


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

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


_LLAMA_SEQ = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
_LLAMA_SMOOTH = (
    SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
LLAMA = Arch("model.layers", _LLAMA_SEQ, _LLAMA_SMOOTH)
GEMMA = Arch("model.layers", _LLAMA_SEQ, _LLAMA_SMOOTH, norm_offset=1.0)
GPT_NEOX = Arch(
    "gpt_neox.layers",
    (("attention.query_key_value",), ("attention.dense",), ("mlp.dense_h_to_4h",), ("mlp.dense_4h_to_h",)),
    (
        SmoothGroup("input_layernorm", ("attention.query_key_value",), "attention"),
        SmoothGroup("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp"),
    ),
    final_norm="gpt_neox.final_layer_norm",
)

ARCHS: dict[str, Arch] = {
    "llama": LLAMA,  # also SmolLM / SmolLM2
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma": GEMMA,
    "gpt_neox": GPT_NEOX,
}


def arch_for(model: nn.Module) -> Arch:
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in ARCHS:
        raise InputError(
            f"architecture '{model_type}' is not supported by layer-by-layer methods yet "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    return ARCHS[model_type]


def get_module(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
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
