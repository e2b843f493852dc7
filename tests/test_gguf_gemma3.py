"""--format gguf for Gemma 3 (llama.cpp's `gemma3` architecture), on tiny Gemma 3 models built from a config.

What differs from llama: norms are written as 1 + w (Gemma's RMSNorm scales by (1 + w), llama.cpp's by the stored
weight), no Q/K row reordering (neox rope), the sliding window in the metadata, the global layers' rope base as
`rope.freq_base`; and what llama.cpp hard-codes (every 6th layer global, the sliding layers' rope base 10000,
attention scaled by 1/sqrt(head_dim), no softcapping) is checked before any work: a model that differs is refused
in one line. Every tensor read back with the `gguf` package equals our weights bit for bit (norms: w + 1 in
float32). One slow test compares llama.cpp's logits with transformers' where llama-cpp-python is installed."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from test_gguf import _dequantized, _llama_logits, _llama_python, _run
from tiny import save_tiny, tiny_tokenizer
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.formats.gguf_export import GGUFOptions, export
from geminicompress.models.loading import load_model

runner = CliRunner()
LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def pattern(n: int) -> list[str]:
    """llama.cpp's gemma3 layer pattern: every 6th layer global."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def save_gemma3(path: Path, layers: int = 2, **overrides) -> Path:
    """A tiny Gemma 3 with random (not unit) norm weights, so that a missing or doubled +1 shows."""
    config = dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                  num_hidden_layers=layers, layer_types=pattern(layers), tie_word_embeddings=True)  # as 270M
    save_tiny(path, "gemma3_text", **{**config, **overrides})
    model = load_model(str(path)).model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(path)
    return path


def _ours(out: Path) -> dict[str, torch.Tensor]:
    """OUT as our loader computes it, by GGUF tensor name; norms as Gemma applies them (1 + w)."""
    model = load_model(str(out)).model
    ours = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": 1 + model.model.norm.weight}
    for i, layer in enumerate(model.model.layers):
        for hf, g in LINEARS.items():
            module = layer.get_submodule(hf)
            ours[f"blk.{i}.{g}.weight"] = module.dequantized_weight() if hasattr(module, "dequantized_weight") \
                else module.weight
        for hf, g in NORMS.items():
            ours[f"blk.{i}.{g}.weight"] = 1 + layer.get_submodule(hf).weight
    return {k: v.detach().float() for k, v in ours.items()}


@pytest.mark.parametrize("stage", [{"method": "rtn", "bits": 4}, {"method": "gptq"}])
def test_gemma3_gguf_equals_our_weights_norms_as_one_plus_w(tmp_path, text_file, stage):
    model_dir = save_gemma3(tmp_path / "g3")
    out = tmp_path / "out"
    report = _run(model_dir, out, text_file if stage["method"] == "gptq" else None, format="gguf", **stage)
    info = report["export"]["gguf"]
    assert info["exact"] and info["types"] == {"Q4_0": 14, "Q8_0": 1, "F32": 13}  # tied head: no output.weight
    found, ours = _dequantized(out / "model.gguf"), _ours(out)
    assert set(found) == set(ours)
    for name, (w, qtype) in found.items():
        mine = ours[name].numpy()
        if name == "token_embd.weight":
            assert qtype == Q.Q8_0 and np.abs(w - mine).max() <= np.abs(mine).max() / 127
        else:
            assert qtype == (Q.F32 if mine.ndim == 1 else Q.Q4_0), name
            assert np.array_equal(w, mine), name  # linears unpermuted; norms exactly 1 + w


def test_gemma3_metadata(tmp_path):
    model_dir = save_gemma3(tmp_path / "g3", layers=6, head_dim=32, query_pre_attn_scalar=32, rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    path = tmp_path / "m.gguf"
    written = export(model_dir, dest=path)
    assert "does not split text as transformers does" in written["tokenizer_warning"]  # built, not copied: said
    assert GGUFReader(path).fields["tokenizer.ggml.add_space_prefix"].contents() is False
    value = {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("tokenizer.ggml.")}
    assert value["general.architecture"] == "gemma3"
    assert value["gemma3.rope.freq_base"] == 500000.0  # the global layers'; llama.cpp takes 10000 for the others
    assert (value["gemma3.rope.scaling.type"], value["gemma3.rope.scaling.factor"]) == ("linear", 4.0)
    assert value["gemma3.attention.sliding_window"] == 4
    assert (value["gemma3.attention.key_length"], value["gemma3.attention.value_length"]) == (32, 32)  # != 64 / 4 heads
    config = json.loads((model_dir / "config.json").read_text())
    assert value["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])


@pytest.mark.parametrize("overrides,needle", [
    ({"layers": 2, "layer_types": ["sliding_attention", "full_attention"]}, "every 6th layer global"),
    ({"query_pre_attn_scalar": 256}, "scales attention by 1/sqrt(16)"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "rope base 10000"),
    ({"final_logit_softcapping": 30.0}, "no logit softcapping"),
])
def test_gemma3_llama_cpp_would_compute_otherwise_refused_before_work(tmp_path, overrides, needle):
    model_dir = save_gemma3(tmp_path / "g3", **overrides)
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(model_dir), "-o", str(out), "--method", "rtn", "--format", "gguf",
                              "--quiet"])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.slow
def test_llama_cpp_computes_our_gemma3(tmp_path):
    """6 layers (5 sliding-window of 4 tokens, 1 global) on 35 tokens: llama.cpp's logits of our F32 file are
    transformers' within 0.5% of the largest logit (measured 0.13%; a wrong sliding window, rope base or attention
    scale is off by 17-140%)."""
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (set GEMINICOMPRESS_LLAMA_PYTHON to a python that has it)")
    model_dir = save_gemma3(tmp_path / "g3", layers=6)
    ids = tiny_tokenizer()("The object is returned by the function when it is called, and then it is gone.")["input_ids"]
    path = tmp_path / "g3.gguf"
    export(model_dir, GGUFOptions(embeddings="f32", floats="f32"), dest=path)
    with torch.no_grad():
        ours = load_model(str(model_dir)).model(torch.tensor([ids])).logits[0]
    assert (_llama_logits(python, path, ids) - ours).abs().max() <= 0.005 * ours.abs().max()
