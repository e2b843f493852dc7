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


# ---- tiny random models of many architectures (configs built in-process, no download) ----

_GQA = dict(num_key_value_heads=2)
# sliding window of 4 tokens on layer 0, global attention on layer 1: a replay that handed layer 1 layer 0's
# mask or rotary embeddings would not match the model's own forward
_ALTERNATING = dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"])
ARCHITECTURES: dict[str, dict] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gpt_neox": {},
    "gemma2": _ALTERNATING, "gemma3_text": _ALTERNATING, "cohere2": dict(_GQA, sliding_window=4,
                                                                          layer_types=["sliding_attention", "full_attention"]),
    "phi3": _GQA, "olmo2": _GQA, "olmo": _GQA, "granite": _GQA, "stablelm": _GQA, "starcoder2": _GQA, "cohere": _GQA,
    "smollm3": _GQA, "glm": _GQA, "ernie4_5": _GQA, "exaone4": _GQA, "opt": dict(ffn_dim=128), "bloom": {},
}
FAST = ("gemma3_text", "olmo2", "phi3", "gpt_neox")  # one of each shape of block; the rest under `slow`


def _params(names):
    return [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in names]


def _tiny(kind: str):
    from tiny import tiny_model

    return tiny_model(kind, **ARCHITECTURES[kind])


def _ids(n: int = 2, t: int = 12) -> torch.Tensor:
    return torch.randint(0, 384, (n, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", _params(ARCHITECTURES))
def test_layer_by_layer_replay_equals_the_models_own_forward(kind):
    """The engine's walk (every layer fed the arguments the model gives *it*) + the model's own head give
    the model's logits: per-layer masks and rotary embeddings (sliding vs global) are replayed as captured."""
    from geminicompress.models.forward import streamed_logits

    model = _tiny(kind)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    parts = dict(streamed_logits(model, ids, device=torch.device("cpu"), head_batch=2))
    torch.testing.assert_close(parts[0], ref, atol=1e-4, rtol=1e-4)


def test_alternating_layers_get_their_own_arguments():
    """Gemma 3: layer 0 (sliding window) and layer 1 (global) are handed different masks and rotary embeddings."""
    from geminicompress.engine.layers import capture_inputs

    inputs = capture_inputs(_tiny("gemma3_text"), _ids(1, 12), torch.device("cpu"))
    first, second = inputs.layer_kwargs
    assert second["attention_mask"] is None or not torch.equal(first["attention_mask"], second["attention_mask"])
    assert first["attention_mask"] is not None  # the sliding window's
    assert not torch.equal(first["position_embeddings"][0], second["position_embeddings"][0])  # rope theta 1e4 vs 1e6
    assert inputs.at(1).kwargs is second and inputs.at(0).kwargs is first


def test_traced_structure_of_new_architectures():
    gemma3 = arch_for(_tiny("gemma3_text"))
    assert gemma3.norm_offset == 1.0 and gemma3.final_norm == "model.norm"
    assert [g.prev for g in gemma3.smooth] == ["input_layernorm", "self_attn.v_proj", "pre_feedforward_layernorm",
                                               "mlp.up_proj"]
    phi3 = arch_for(_tiny("phi3"))  # fused projections: no linear feeds through attention or the gated MLP
    assert phi3.sequential == (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))
    assert [g.prev for g in phi3.smooth] == ["input_layernorm", "post_attention_layernorm"]
    olmo2 = arch_for(_tiny("olmo2"))  # post-norm blocks: the layer's input feeds q/k/v directly
    assert olmo2.unfed[0] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    cohere = arch_for(_tiny("cohere"))  # parallel attention and MLP: one norm feeds both
    assert cohere.smooth[0].linears[-2:] == ("mlp.gate_proj", "mlp.up_proj") and cohere.smooth[0].inspect == ""
