"""`quantize --format gguf --gguf-type MIX`: llama-quantize's per-tensor types, our codes in them; the dense
checkpoint beside model.gguf holds exactly the weights llama.cpp reads from it (bit for bit, float32); GPTQ on the
K grids lowers GPTQ's loss against llama.cpp's own rounding of the same rows; bad input is one line, exit 2."""

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from tiny import save_tiny
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.gptq.kgrid_solve import gptq_kquant
from geminicompress.core.kgrid import KTYPES
from geminicompress.core.kquant import quantize
from geminicompress.formats.gguf_kpack import QTYPES, pack
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage
from test_gguf import GGUF_NAMES, _unpermute

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny llama whose rows are 256 (K types) and 320 (their fallbacks) wide, tied embeddings."""
    return save_tiny(tmp_path_factory.mktemp("wide") / "m", hidden_size=256, intermediate_size=320,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)


def _run(model_dir, out, text=None, **stage):
    data = {"data": str(text), "samples": 8, "seq_len": 64} if text else {}
    return run_recipe(recipe_from_stage(str(model_dir), {"type": "quantize", "format": "gguf", **stage}, data, "t"),
                      out, RunOptions(device=CPU))


def _check_file_is_the_checkpoint(out):
    """Every decoder linear of model.gguf, dequantized by gguf, equals OUT's float32 weight bit for bit."""
    from safetensors.torch import load_file

    config = json.loads((out / "config.json").read_text())
    state = {}
    for f in sorted(out.glob("model*.safetensors")):
        state.update(load_file(str(f)))
    types = {}
    for t in GGUFReader(str(out / "model.gguf")).tensors:
        if not t.name.startswith("blk.") or not t.name.endswith(".weight") or len(t.shape) < 2:
            continue
        i, g = int(t.name.split(".")[1]), t.name.split(".")[2]
        hf = next(k for k, v in GGUF_NAMES.items() if v == g)
        w = _unpermute(t.name, quants.dequantize(t.data, t.tensor_type).reshape(*reversed(t.shape.tolist())), config)
        mine = state[f"model.layers.{i}.{hf}.weight"].float().numpy()
        assert np.array_equal(w, mine), t.name
        types[t.name] = t.tensor_type.name
    return types


@pytest.mark.parametrize("method,mix", [("rtn", "Q4_K_M"), ("rtn", "Q2_K"), ("rtn", "IQ4_XS"), ("rtn", "Q6_K"),
                                        ("gptq", "Q3_K_M"), ("gptq", "IQ4_NL")])
def test_the_mix_s_types_hold_our_weights_bit_for_bit(wide_dir, text_file, tmp_path, method, mix):
    stage = {"method": method, "gguf_type": mix, **({"scale_search": "none"} if method == "gptq" else {})}
    report = _run(wide_dir, tmp_path / "o", text_file if method == "gptq" else None, **stage)
    types = _check_file_is_the_checkpoint(tmp_path / "o")
    # 2 layers: use_more_bits holds for layer 1 only; n/8 = n/16 = 0
    expect = {"Q4_K_M": ("blk.0.attn_q.weight", "Q4_K", "blk.1.ffn_down.weight", "Q8_0"),  # Q6_K on 320: Q8_0
              "Q2_K": ("blk.0.attn_q.weight", "Q2_K", "blk.0.attn_v.weight", "Q4_K"),  # GQA 4
              "IQ4_XS": ("blk.1.ffn_up.weight", "IQ4_XS", "blk.1.ffn_down.weight", "IQ4_NL"),
              "Q3_K_M": ("blk.0.attn_v.weight", "Q5_K", "blk.0.ffn_down.weight", "Q5_0"),
              "IQ4_NL": ("blk.0.attn_q.weight", "IQ4_NL", "blk.0.attn_v.weight", "Q5_K"),
              "Q6_K": ("blk.0.ffn_gate.weight", "Q6_K", "blk.0.ffn_down.weight", "Q8_0")}[mix]
    assert types[expect[0]] == expect[1] and types[expect[2]] == expect[3], types
    assert report["export"]["gguf"]["types"]
    emb = next(t for t in GGUFReader(str(tmp_path / "o" / "model.gguf")).tensors if t.name == "token_embd.weight")
    assert emb.tensor_type.name == ("Q8_0" if mix in ("Q8_0",) else "Q6_K")  # tied, 256 wide: the output's Q6_K


def test_gptq_on_k_grids_beats_llama_cpp_s_rounding_in_gptq_s_loss():
    torch.manual_seed(0)
    X = torch.randn(2048, 512) @ (torch.randn(512, 512) * 0.1 + torch.eye(512))  # correlated inputs
    H = 2 * X.T @ X / X.shape[0]
    W = torch.randn(64, 512) * 0.05
    for name in ("Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS"):
        codes, _ = gptq_kquant(W, H, name)
        ours = torch.from_numpy(codes.dequantize())
        assert np.array_equal(quants.dequantize(pack(codes), QTYPES[name]), codes.dequantize())
        rtn = torch.from_numpy(quantize(W.numpy(), name, torch.diag(H).numpy()).dequantize())
        loss = [float(torch.einsum("oi,ij,oj->", W - q, H, W - q)) for q in (ours, rtn)]
        assert loss[0] < 0.8 * loss[1], (name, loss)
        assert KTYPES[name].block_bytes > 0


def test_a_mix_llama_cpp_does_not_have_is_one_line_exit_2(wide_dir, tmp_path):
    res = CliRunner().invoke(app, ["quantize", str(wide_dir), "-o", str(tmp_path / "o"), "--method", "rtn",
                                   "--format", "gguf", "--gguf-type", "Q7_K", "--quiet"])
    assert res.exit_code == 2 and "Q7_K" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(app, ["quantize", str(wide_dir), "-o", str(tmp_path / "o"), "--method", "rtn",
                                   "--gguf-type", "Q4_K_M", "--quiet"])
    assert res.exit_code == 2 and "gguf" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    res = CliRunner().invoke(app, ["quantize", str(wide_dir), "-o", str(tmp_path / "o"), "--method", "awq",
                                   "--format", "gguf", "--gguf-type", "Q4_K_M", "--quiet"])
    assert res.exit_code == 2 and "gptq and rtn" in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_llama_cpp_computes_our_logits_on_a_model_256_divides(tmp_path):
    """Hidden 1024 / intermediate 2816 (every row a K type), 2 layers, GQA 4: llama.cpp's logits of each mix's file
    against our torch logits of OUT's dense checkpoint (the same weights, float32). llama.cpp multiplies K-quant
    weights with activations rounded to 8 bits (q8_K per 256, q8_0 per 32), so the match is close, not exact: the
    K types land where the legacy types (whose files #37 checked) do."""
    from test_gguf import _llama_logits, _llama_python
    from tiny import tiny_tokenizer

    from geminicompress.models.loading import load_model

    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (set GEMINICOMPRESS_LLAMA_PYTHON)")
    model_dir = save_tiny(tmp_path / "synth", hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                          num_attention_heads=16, num_key_value_heads=4)
    ids = tiny_tokenizer()("The object is returned by the function when it is called.")["input_ids"]
    for mix in ("Q8_0", "Q4_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"):
        out = tmp_path / mix
        _run(model_dir, out, method="rtn", gguf_type=mix)
        types = _check_file_is_the_checkpoint(out)
        assert KTYPES.get(mix.removesuffix("_M")) is None or mix.removesuffix("_M") in types.values(), types
        model = load_model(str(out)).model
        with torch.no_grad():  # the embedding and the head are quantized at export: theirs, into our model
            for t in GGUFReader(str(out / "model.gguf")).tensors:
                target = {"token_embd.weight": model.model.embed_tokens, "output.weight": model.lm_head}.get(t.name)
                if target is not None:
                    w = quants.dequantize(t.data, t.tensor_type).reshape(*reversed(t.shape.tolist()))
                    target.weight.copy_(torch.from_numpy(w))
            ours = model(torch.tensor([ids])).logits[0]
        theirs = _llama_logits(python, out / "model.gguf", ids)
        rel = float((theirs - ours).abs().max() / ours.abs().max())
        assert rel < 0.1, (mix, rel)  # measured: Q8_0 0.023, Q4_0 0.045, K types 0.057-0.082, IQ4_NL 0.027
        print(mix, "max |llama.cpp - torch| / max |logit|:", round(rel, 5))


def test_the_trial_of_d_never_loses_to_llama_cpp_s_d(monkeypatch):
    """Each row keeps the least GPTQ loss among d and its multiples, d itself first: no row worse than d alone."""
    from geminicompress.compress.gptq import kgrid_solve

    torch.manual_seed(1)
    X = torch.randn(1024, 256) @ (torch.randn(256, 256) * 0.1 + torch.eye(256))
    H = 2 * X.T @ X / X.shape[0]
    W = torch.randn(32, 256) * 0.05
    for name in ("Q4_K", "IQ4_NL"):
        _, with_trial = gptq_kquant(W, H, name)
        monkeypatch.setattr(kgrid_solve, "TRIAL_FACTORS", (1.0,))
        _, alone = gptq_kquant(W, H, name)
        monkeypatch.undo()
        assert with_trial < alone, (name, with_trial, alone)


def test_a_gguf_file_behind_a_link_of_another_name_loads(wide_dir, tmp_path):
    """MODEL may be a link to a .gguf file named otherwise (a work folder of links): the file it points to loads."""
    import shutil

    from geminicompress.models.loading import load_model

    _run(wide_dir, tmp_path / "o", method="rtn", gguf_type="Q8_0")
    shutil.copy(tmp_path / "o" / "model.gguf", tmp_path / "renamed.gguf")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "model.gguf").symlink_to(tmp_path / "renamed.gguf")
    direct = load_model(str(tmp_path / "renamed.gguf")).model
    linked = load_model(str(tmp_path / "links" / "model.gguf")).model
    a, b = direct.state_dict(), linked.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
