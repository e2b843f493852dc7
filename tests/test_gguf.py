"""--format gguf: OUT/model.gguf holds our codes and scales as llama.cpp's blocks, not re-quantized.

Every type we write is read back with the `gguf` package (`gguf.quants.dequantize`, the reference of llama.cpp's
own dequantization) and compared bit for bit with the weights our loader computes from OUT's checkpoint (Q4_1's
rounded offset: within its stated bound); refusals are one line, exit 2, nothing written; the tokenizer metadata
round-trips. One slow test loads the file in llama.cpp where llama-cpp-python is installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants
from tiny import save_tiny, tiny_tokenizer
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.formats import gguf as blocks
from geminicompress.formats.gguf_export import GGUFOptions, export
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
runner = CliRunner()


# --------------------------------------------------------------------------- blocks (pure)

@pytest.mark.parametrize("bits,group,sym,asym,qtype", [
    (4, 32, True, "q5_0", Q.Q4_0), (3, 64, True, "q5_0", Q.Q4_0), (2, -1, True, "q5_0", Q.Q4_0),
    (8, 32, True, "q5_0", Q.Q8_0), (8, -1, True, "q5_0", Q.Q8_0),
    (4, 32, False, "q5_0", Q.Q5_0), (3, 64, False, "q5_0", Q.Q5_0), (2, 32, False, "q5_0", Q.Q5_0),
])
def test_exact_types_dequantize_to_our_weights_bit_for_bit(bits, group, sym, asym, qtype):
    torch.manual_seed(bits)
    qw = rtn_quantize(torch.randn(48, 128), QuantSpec(bits, group, sym))
    qw.scales = qw.scales.half().float()  # what gptq/awq/gguf store
    enc = blocks.encode_quantized(qw, asym)
    assert enc.qtype == qtype and enc.max_step_error == 0.0
    back = quants.dequantize(enc.data, enc.qtype)
    assert back.shape == (48, 128) and np.array_equal(back, qw.dequantize().numpy())


def test_symmetric_5_bit_is_q5_0_bit_for_bit():
    try:
        spec = QuantSpec(5, 32, True)
    except Exception:  # noqa: BLE001  (5-bit grids come with GPTQ's Q5_0 support)
        pytest.skip("this build has no 5-bit grid")
    torch.manual_seed(5)
    qw = rtn_quantize(torch.randn(48, 128), spec)
    qw.scales = qw.scales.half().float()
    enc = blocks.encode_quantized(qw)
    assert enc.qtype == Q.Q5_0 and np.array_equal(quants.dequantize(enc.data, Q.Q5_0), qw.dequantize().numpy())


def test_q4_1_offset_is_rounded_within_its_bound():
    torch.manual_seed(0)
    qw = rtn_quantize(torch.randn(64, 256) * 0.05, QuantSpec(4, 32, False))
    qw.scales = qw.scales.half().float()
    enc = blocks.encode_quantized(qw, "q4_1")
    assert enc.qtype == Q.Q4_1
    back, ours = quants.dequantize(enc.data, Q.Q4_1), qw.dequantize().numpy()
    step = qw.scales[:, qw.g_idx.long()].numpy()
    err = np.abs(back - ours) / step
    # m = fp16(-s·z): at most half an fp16 ulp of 15·s, i.e. 15·2^-11 ≈ 0.0073 of a step (+ float32 rounding)
    assert 0 < enc.max_step_error <= 15 * 2 ** -11 and err.max() <= 15 * 2 ** -11 + 1e-5


def test_blocks_that_span_two_groups_and_asymmetric_8_bit_are_refused():
    qw = rtn_quantize(torch.randn(8, 64), QuantSpec(4, 16, True))
    with pytest.raises(Exception, match="block of 32 input columns"):
        blocks.encode_quantized(qw)
    with pytest.raises(Exception, match="asymmetric 8-bit"):
        blocks.encode_quantized(rtn_quantize(torch.randn(8, 64), QuantSpec(8, 32, False)))


def test_qk_permutation_is_llama_cpps():
    w = torch.arange(4 * 8).reshape(8, 4)  # 2 heads of 4 rows
    ref = w.reshape(2, 2, 2, 4).swapaxes(1, 2).reshape(8, 4)  # convert_hf_to_gguf's LlamaModel.permute
    assert torch.equal(w[blocks.qk_permutation(8, 2)], ref)


# --------------------------------------------------------------------------- the file, end to end

def _dequantized(path: Path) -> dict[str, tuple[np.ndarray, Q]]:
    return {t.name: (quants.dequantize(t.data, t.tensor_type).reshape(*reversed(t.shape.tolist())), t.tensor_type)
            for t in GGUFReader(path).tensors}


def _unpermute(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """Undo the Q/K row permutation of the llama architecture."""
    if config["model_type"] not in ("llama", "mistral") or w.ndim != 2:
        return w
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if kind not in heads:
        return w
    perm = blocks.qk_permutation(w.shape[0], heads[kind]).numpy()
    out = np.empty_like(w)
    out[perm] = w
    return out


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _ours(out: Path) -> dict[str, torch.Tensor]:
    """OUT as our loader computes it, by GGUF tensor name."""
    model = load_model(str(out)).model
    ours = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not model.config.tie_word_embeddings:
        ours["output.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        for hf, g in GGUF_NAMES.items():
            module = layer.get_submodule(hf)
            ours[f"blk.{i}.{g}.weight"] = module.dequantized_weight() if hasattr(module, "dequantized_weight") \
                else module.weight  # an INT8 module's `weight` holds its codes
            if getattr(module, "bias", None) is not None:
                ours[f"blk.{i}.{g}.bias"] = module.bias
    return {k: v.detach().float() for k, v in ours.items()}


def assert_gguf_equals_ours(out: Path, linears: Q, types: dict[str, Q] | None = None) -> dict:
    """Every tensor of OUT/model.gguf, dequantized by `gguf`, equals what our loader computes from OUT: bit for
    bit, except the Q8_0 embeddings (quantized at export, as llama.cpp does). `linears`: the expected type
    of the quantized linears, `types` the exceptions by GGUF name."""
    config = json.loads((out / "config.json").read_text())
    found, ours = _dequantized(out / "model.gguf"), _ours(out)
    assert set(found) == set(ours)
    for name, (w, qtype) in found.items():
        mine = ours[name].numpy()
        w = _unpermute(name, w, config)
        if name.startswith("token_embd") or name == "output.weight":
            assert qtype == Q.Q8_0
            step = np.abs(mine.reshape(mine.shape[0], -1, 32)).max(-1, keepdims=True) / 127
            bound = step * (0.5 + 127 * 2 ** -11)  # half a step, plus |q| ≤ 127 times d's fp16 rounding
            assert (np.abs(w - mine).reshape(step.shape[0], -1, 32) <= bound + 1e-7).all(), name
            continue
        if mine.ndim == 1:
            assert qtype == Q.F32
        else:
            assert qtype == (types or {}).get(name, linears), name
        assert np.array_equal(w, mine), name
    return config


def _run(model_dir: Path, out: Path, text: Path | None = None, **stage) -> dict:
    data = {"data": str(text), "samples": 4, "seq_len": 64} if text else {}
    recipe = recipe_from_stage(str(model_dir), {"type": "quantize", **stage}, data, "test")
    return run_recipe(recipe, out, RunOptions(device=CPU))


@pytest.mark.parametrize("stage,qtype", [
    ({"method": "rtn", "bits": 4}, Q.Q4_0),
    ({"method": "rtn", "bits": 4, "sym": False}, Q.Q5_0),
    ({"method": "rtn", "bits": 8, "group_size": -1}, Q.Q8_0),
    ({"method": "int8"}, Q.Q8_0),
    ({"method": "w8a8", "smoothquant_alpha": 0}, Q.Q8_0),
])
def test_gguf_of_every_type_equals_our_dequantized_weights(tiny_dir, tmp_path, stage, qtype):
    report = _run(tiny_dir, tmp_path / "out", format="gguf", **stage)
    info = report["export"]["gguf"]
    linears = 7 * 2 + (2 if qtype == Q.Q8_0 else 0)  # the Q8_0 embeddings and (untied, float) output head too
    assert info["exact"] and info["types"][qtype.name] == linears and info["tokenizer"] == "built (gpt2)"
    assert report["export"]["verified"]  # the checkpoint beside it is verified as always
    assert_gguf_equals_ours(tmp_path / "out", qtype)


def test_gptq_defaults_to_groups_of_32_and_writes_q4_0(tiny_dir, text_file, tmp_path):
    report = _run(tiny_dir, tmp_path / "out", text_file, method="gptq", format="gguf")
    assert report["stages"][0]["result"]["group_size"] == 32
    assert_gguf_equals_ours(tmp_path / "out", Q.Q4_0)


def test_awq_zero_points_as_q4_1_within_the_bound(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    report = _run(tiny_dir, out, text_file, method="awq", format="gguf", gguf_asym="q4_1", search_windows=2, n_grid=4)
    info = report["export"]["gguf"]
    assert info["types"]["Q4_1"] == 14 and 0 < info["q4_1_max_m_error_steps"] <= 15 * 2 ** -11
    found, ours = _dequantized(out / "model.gguf"), _ours(out)
    config = json.loads((out / "config.json").read_text())
    w = _unpermute("blk.1.ffn_down.weight", found["blk.1.ffn_down.weight"][0], config)
    assert np.abs(w - ours["blk.1.ffn_down.weight"].numpy()).max() > 0  # rounded, as stated


def test_mixed_precision_writes_per_tensor_types(tiny_dir, text_file, tmp_path):
    _run(tiny_dir, tmp_path / "out", text_file, method="gptq", format="gguf",
         overrides={"model.layers.0.self_attn.v_proj": "b8g32", "model.layers.1.mlp.down_proj": "b3g64"})
    assert_gguf_equals_ours(tmp_path / "out", Q.Q4_0, {"blk.0.attn_v.weight": Q.Q8_0})


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_architectures_qwen2_biases_unpermuted_mistral_as_llama(tmp_path, kind):
    model_dir = save_tiny(tmp_path / kind, kind)
    report = _run(model_dir, tmp_path / "out", method="rtn", bits=4, format="gguf")
    assert report["export"]["gguf"]["exact"]
    arch = GGUFReader(tmp_path / "out" / "model.gguf").fields["general.architecture"].contents()
    assert arch == {"qwen2": "qwen2", "mistral": "llama"}[kind]
    assert_gguf_equals_ours(tmp_path / "out", Q.Q4_0)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_scaling_writes_the_factors_transformers_applies(tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    model_dir = save_tiny(tmp_path / "l3", rope_parameters=LLAMA3_ROPE)
    export(model_dir, dest=tmp_path / "m.gguf")
    found = {t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "m.gguf").tensors}
    scaled, _ = _compute_llama3_parameters(AutoConfig.from_pretrained(model_dir))
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # head_dim 16
    np.testing.assert_allclose(found["rope_freqs.weight"], (plain / scaled).numpy(), rtol=1e-5)


def test_dense_checkpoint_exports_as_f32_and_f16(tiny_dir, tmp_path):
    path = tmp_path / "f32.gguf"
    export(tiny_dir, GGUFOptions(embeddings="f32", floats="f32"), dest=path)
    found = _dequantized(path)
    model = load_model(str(tiny_dir)).model
    config = json.loads((tiny_dir / "config.json").read_text())
    q = _unpermute("blk.0.attn_q.weight", found["blk.0.attn_q.weight"][0], config)
    assert found["blk.0.attn_q.weight"][1] == Q.F32 and np.array_equal(q, model.model.layers[0].self_attn.q_proj.weight.detach().numpy())
    assert np.array_equal(found["token_embd.weight"][0], model.model.embed_tokens.weight.detach().numpy())
    export(tiny_dir, GGUFOptions(embeddings="f16"), dest=tmp_path / "f16.gguf")
    found = _dequantized(tmp_path / "f16.gguf")
    assert found["blk.0.ffn_up.weight"][1] == Q.F16 and found["token_embd.weight"][1] == Q.F16
    up = model.model.layers[0].mlp.up_proj.weight.detach().half().float().numpy()
    assert np.array_equal(found["blk.0.ffn_up.weight"][0], up)


def test_metadata_llama_cpp_reads(tiny_dir, tmp_path):
    path = tmp_path / "m.gguf"
    export(tiny_dir, dest=path)
    fields = GGUFReader(path).fields
    value = {k: f.contents() for k, f in fields.items() if not k.startswith("tokenizer.ggml.")}
    config = json.loads((tiny_dir / "config.json").read_text())
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    assert value["llama.rope.freq_base"] == pytest.approx(rope)
    assert value["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    assert (value["llama.block_count"], value["llama.attention.head_count"], value["llama.attention.head_count_kv"],
            value["llama.embedding_length"], value["llama.feed_forward_length"]) == (2, 4, 2, 64, 128)


# --------------------------------------------------------------------------- tokenizer metadata

def test_tokenizer_built_from_tokenizer_json_round_trips(tiny_dir, tmp_path):
    path = tmp_path / "m.gguf"
    export(tiny_dir, dest=path)
    fields = GGUFReader(path).fields
    tok = tiny_tokenizer()
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"  # a plain byte-level BPE: GPT-2's regex
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert tokens == [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    assert fields["tokenizer.ggml.token_type"].contents()[0] == 3  # <|endoftext|>: control
    merges = json.loads((tiny_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert len(fields["tokenizer.ggml.merges"].contents()) == len(merges)
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id


def save_sentencepiece_tiny(path: Path) -> Path:
    """A tiny Llama with a SentencePiece-style BPE tokenizer (▁ for spaces, byte fallback), as Llama 2 ships."""
    from pydoc_data.topics import topics

    from tiny import tiny_model
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first")  # for training: no merge across ▁
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:40],
                            trainers.BpeTrainer(vocab_size=384, special_tokens=special, show_progress=False))
    tok.pre_tokenizer = None  # as Llama 2's tokenizer.json: spaces become ▁ in the normalizer
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tiny_model("llama", bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


def test_sentencepiece_style_tokenizer_is_written_as_llama(tmp_path):
    model_dir = save_sentencepiece_tiny(tmp_path / "sp")
    info = export(model_dir, dest=tmp_path / "m.gguf")
    fields = GGUFReader(tmp_path / "m.gguf").fields
    assert info["tokenizer"] == "built (llama)"
    assert (fields["tokenizer.ggml.model"].contents(), fields["tokenizer.ggml.pre"].contents()) == ("llama", "default")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 384 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[1] == 3 and types[3] == 6  # <s>: control; <0x00>: byte
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1 and len(fields["tokenizer.ggml.scores"].contents()) == 384


def test_tokenizer_copied_from_the_source_gguf(tiny_dir, tmp_path):
    source = tmp_path / "source.gguf"
    w = GGUFWriter(source, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["a", "b", "<x>"])
    w.add_token_types([1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(2)
    w.add_chat_template("{{ hi }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "m.gguf"
    info = export(tiny_dir, source_gguf=source, dest=path)
    assert info["tokenizer"] == "copied from source.gguf"
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "<x>"]
    assert fields["tokenizer.ggml.token_type"].contents() == [1, 1, 3]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 2
    assert fields["tokenizer.chat_template"].contents() == "{{ hi }}"


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("args,needle", [
    (["--method", "rtn", "--group-size", "16"], "multiple of 32"),
    (["--method", "rtn", "--bits", "8", "--asym"], "asymmetric 8-bit"),
    (["--method", "gptq", "--act-order", "group"], "act_order static or none"),
])
def test_bad_input_one_line_exit_2_nothing_written(tiny_dir, tmp_path, args, needle):
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--format", "gguf", "--quiet", *args])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


def test_gguf_options_need_format_gguf(tiny_dir, tmp_path):
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "o"), "--method", "rtn",
                              "--gguf-asym", "q4_1", "--quiet"])
    assert res.exit_code == 2 and "applies to format gguf only" in res.output


@pytest.mark.parametrize("kind,overrides,needle", [
    ("gpt_neox", {}, "writes the architectures llama, mistral, qwen2"),
    ("llama", {"hidden_size": 48, "num_attention_heads": 4}, "not a multiple of 32"),
])
def test_model_gguf_cannot_hold_is_refused_before_work(tmp_path, kind, overrides, needle):
    model_dir = save_tiny(tmp_path / kind, kind, **overrides)
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(model_dir), "-o", str(out), "--method", "rtn", "--format", "gguf",
                              "--quiet"])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


# --------------------------------------------------------------------------- llama.cpp itself

def _llama_python() -> str | None:
    given = os.environ.get("GEMINICOMPRESS_LLAMA_PYTHON")
    candidates = [given] if given else [sys.executable, "/work/venv-llama/bin/python"]
    for python in candidates:
        if python and Path(python).exists() and subprocess.run([python, "-c", "import llama_cpp"],
                                                               capture_output=True, check=False).returncode == 0:
            return python
    return None


_TOKENIZE = """
import json, sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps(llm.tokenize(sys.argv[2].encode(), add_bos=False, special=False)))
"""

_SCORE = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(path, logits_all=True, n_ctx=64, verbose=False)
llm.eval(ids)
print(json.dumps(np.asarray(llm.scores[:len(ids)]).tolist()))
"""


def _llama_logits(python: str, path: Path, ids: list[int]) -> torch.Tensor:
    res = subprocess.run([python, "-c", _SCORE, str(path), json.dumps(ids)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return torch.tensor(json.loads(res.stdout))


@pytest.mark.slow
def test_llama_cpp_loads_the_files_and_agrees_with_our_logits(tiny_dir, tmp_path):
    """F32: llama.cpp's logits equal ours to float rounding. Q4_0 (our rtn codes): close; llama.cpp rounds the
    activations to 8 bits in these matmuls (measured on this tiny model: 1.8% of the largest logit)."""
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (set GEMINICOMPRESS_LLAMA_PYTHON to a python that has it)")
    ids = tiny_tokenizer()("The object is returned by the function when it is called.")["input_ids"]
    for model_dir in (tiny_dir, save_tiny(tmp_path / "l3", rope_parameters=LLAMA3_ROPE)):  # + Llama 3.1 rope
        path = tmp_path / f"{model_dir.name}.gguf"
        export(model_dir, GGUFOptions(embeddings="f32", floats="f32"), dest=path)
        with torch.no_grad():
            ours = load_model(str(model_dir)).model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_llama_logits(python, path, ids), ours, atol=2e-3, rtol=1e-3)
    out = tmp_path / "q4"
    _run(tiny_dir, out, method="rtn", bits=4, format="gguf", gguf_embeddings="f32")
    with torch.no_grad():
        ours = load_model(str(out)).model(torch.tensor([ids])).logits[0]
    theirs = _llama_logits(python, out / "model.gguf", ids)
    assert (theirs - ours).abs().max() <= 0.05 * ours.abs().max()


@pytest.mark.slow
def test_llama_cpp_tokenizes_as_transformers_with_the_metadata_we_build(tiny_dir, tmp_path):
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (set GEMINICOMPRESS_LLAMA_PYTHON to a python that has it)")
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = topics[sorted(topics)[50]][:3000]
    for model_dir in (tiny_dir, save_sentencepiece_tiny(tmp_path / "sp")):  # byte-level BPE; SentencePiece-style
        path = tmp_path / f"{model_dir.name}.gguf"
        export(model_dir, dest=path)
        res = subprocess.run([python, "-c", _TOKENIZE, str(path), text], capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        ids = AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"]
        assert json.loads(res.stdout) == ids, model_dir.name


def test_streamed_run_writes_the_same_file(tiny_dir, tmp_path):
    """`--stream` (layer by layer from disk) writes the same checkpoint, so the same GGUF bytes."""
    for stream in (False, True):
        recipe = recipe_from_stage(str(tiny_dir), {"type": "quantize", "method": "rtn", "bits": 4, "format": "gguf"},
                                   {}, "test")
        run_recipe(recipe, tmp_path / f"out{stream}", RunOptions(device=CPU, stream=stream))
    assert (tmp_path / "outTrue" / "model.gguf").read_bytes() == (tmp_path / "outFalse" / "model.gguf").read_bytes()
