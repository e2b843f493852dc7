"""Architectures found by tracing (compress/trace.py), not by a table: the six entries arch.py once wrote by
hand come back exactly, and tiny random models of many other architectures run every layer-by-layer method."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from geminicompress.compress.arch import Arch, SmoothGroup, arch_for, traced_arch
from tiny import tiny_config

# the table compress/arch.py held before tracing (issue #36), verbatim
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
HAND_WRITTEN = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gemma": GEMMA, "gpt_neox": GPT_NEOX}
_TABLE_FIELDS = ("layers", "sequential", "smooth", "norm_offset", "final_norm")


@pytest.mark.parametrize("kind", sorted(HAND_WRITTEN))
def test_tracing_reproduces_the_hand_written_table(kind):
    traced = traced_arch(AutoModelForCausalLM.from_config(tiny_config(kind)))
    for field in _TABLE_FIELDS:
        assert getattr(traced, field) == getattr(HAND_WRITTEN[kind], field), field
