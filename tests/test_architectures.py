"""Architectures found by tracing (core/trace.py), not by a table: the six entries arch.py once wrote by
hand come back exactly, and tiny random models of many other architectures run every layer-by-layer method."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config
from transformers import AutoModelForCausalLM

from geminicompress.core.arch import Arch, SmoothGroup, arch_for, traced_arch

# the table core/arch.py held before tracing (issue #36), verbatim
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
    "smollm3": _GQA, "glm": _GQA, "ernie4_5": _GQA, "exaone4": _GQA,
}
# traced right but not run: OPT flattens its MLP's inputs to (b·T, d) (GPTQ's first-token weight needs
# windows) and BLOOM's ALiBi bias has the batch in its shape (the walk runs windows batched)
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
    from geminicompress.engine.forward import streamed_logits

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


# ---- every layer-by-layer method on each architecture, in memory and streamed ----

METHODS: dict[str, tuple[list[str], float]] = {  # CLI arguments, bound on the logits' relative error vs float
    "int8": (["quantize", "--method", "int8"], 0.05),
    "w8a8": (["quantize", "--method", "w8a8"], 0.1),
    "rtn": (["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32"], 0.5),
    "gptq": (["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32"], 0.5),
    "awq": (["quantize", "--method", "awq", "--bits", "4", "--group-size", "32"], 0.5),
    "magnitude": (["prune", "--method", "magnitude", "--sparsity", "0.3"], 0.8),
    "wanda": (["prune", "--method", "wanda", "--sparsity", "0.3"], 0.8),
    "sparsegpt": (["prune", "--method", "sparsegpt", "--sparsity", "0.3"], 0.8),
}
_CALIB = ["--samples", "8", "--calib-seq-len", "64", "-q", "--dtype", "float32"]  # GPTQ: tokens >= widest input
# the fast matrix (the rest under `slow`): Gemma 3 (alternating attention, 1 + w norms) in memory and streamed,
# Phi-3's fused projections streamed through SmoothQuant, OLMo 2's post-norm blocks refusing AWQ
FAST_RUNS = {("gemma3_text", "int8", False), ("gemma3_text", "awq", False), ("gemma3_text", "gptq", True),
             ("phi3", "w8a8", True), ("olmo2", "awq", False)}


def _relative_error(out, ref) -> float:
    return float((out - ref).norm() / (ref - ref.mean(-1, keepdim=True)).norm())


def _runs():
    for kind in ARCHITECTURES:
        for method in METHODS:
            for stream in (False, True):
                fast = (kind, method, stream) in FAST_RUNS
                yield pytest.param(kind, method, stream, marks=() if fast else pytest.mark.slow,
                                   id=f"{kind}-{method}-{'stream' if stream else 'memory'}")


@pytest.mark.parametrize("kind,method,stream", list(_runs()))
def test_every_method_runs_and_reloads(tmp_path_factory, kind, method, stream):
    """The run succeeds (its own check loads OUT back and compares logits with the in-process model), and OUT,
    loaded as a user would, is within the method's usual error of the float model. AWQ on a block without a
    norm in front of its first linears is refused in one line (exit 2)."""
    from tiny import save_tiny
    from typer.testing import CliRunner

    from geminicompress.cli import app
    from geminicompress.models.loading import load_model

    base = tmp_path_factory.getbasetemp() / f"arch-{kind}"
    if not (base / "config.json").exists():
        save_tiny(base, kind, **ARCHITECTURES[kind])
    out = tmp_path_factory.mktemp("out") / "o"
    args, bound = METHODS[method]
    res = CliRunner().invoke(app, [args[0], str(base), "-o", str(out), *args[1:], *_CALIB,
                                   "--stream" if stream else "--no-stream"])
    if method == "awq" and arch_for(_tiny(kind)).sequential[0] in arch_for(_tiny(kind)).unfed:
        assert res.exit_code == 2 and "missing feed: norm ->" in res.output and "still work" in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
        return
    assert res.exit_code == 0, res.output
    ids = _ids(2, 16)
    with torch.no_grad():
        ref = load_model(str(base)).model(ids).logits
        got = load_model(str(out)).model(ids).logits
    err = _relative_error(got, ref)
    assert 0 < err < bound, err
