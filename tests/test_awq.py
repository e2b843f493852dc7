"""AWQ: the search math on known answers, folding preserves the function, the stage on tiny models
(search beats RTN when inputs have outlier channels; saved search re-applies to identical weights)."""

import json

import pytest
import torch
from tiny import save_tiny, tiny_model
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.awq.search import (
    apply_clip,
    linear_error,
    pseudo_quantize,
    search_clip,
    search_scales,
    smooth_scales,
)
from geminicompress.compress.fold import fold_problem, fold_scales
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.core.arch import arch_for, decoder_layers, get_module
from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread_module")


# --------------------------------------------------------------------------- search math


def test_pseudo_quantize_matches_rtn():
    w = torch.randn(8, 64)
    for spec in (QuantSpec(4, 16, sym=False), QuantSpec(3, -1, sym=True), QuantSpec(4, 24, sym=False)):
        torch.testing.assert_close(pseudo_quantize(w, spec), rtn_quantize(w, spec).dequantize(), atol=1e-6, rtol=0)


def test_smooth_scales_normalised_and_alpha_zero_is_identity():
    x_mean = torch.tensor([0.1, 1.0, 10.0, 100.0])
    assert torch.equal(smooth_scales(x_mean, 0.0), torch.ones(4))
    s = smooth_scales(x_mean, 0.5)
    torch.testing.assert_close(s.max() * s.min(), torch.tensor(1.0))
    assert torch.all(s[1:] > s[:-1])  # larger activations get larger scales


def _outlier_inputs(tokens=2048, cols=64, outliers=(3, 17), gain=30.0):
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(0))
    x[:, list(outliers)] *= gain
    return x


def test_scale_search_protects_outlier_channels_and_beats_rtn():
    x = _outlier_inputs()
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    acc = HessianAccumulator(64)
    acc.add_batch(x)
    spec = QuantSpec(3, 32, sym=False)
    s, alpha, err, rtn_err = search_scales(x.abs().mean(0), linear_error([w], acc.H, spec), n_grid=20)
    assert alpha > 0 and err < 0.7 * rtn_err
    assert s[3] > s[0] and s[17] > s[0]
    # the Gram-matrix error is the mean squared output error, measured directly
    wq = pseudo_quantize(w * s, spec) / s
    direct = ((x @ wq.T - x @ w.T) ** 2).mean()
    torch.testing.assert_close(torch.tensor(err), direct, rtol=1e-3, atol=0)


def test_clip_search_never_hurts_and_clamps():
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    w[0, 5] = 6.0  # one large weight stretches its group's range
    spec = QuantSpec(3, 16, sym=False)
    bound = search_clip(w, x, spec)
    assert bound.shape == (8, 4)
    org = w.abs().reshape(8, 4, 16).amax(-1)
    assert torch.all(bound <= org + 1e-6) and torch.all(bound >= 0.5 * org - 1e-6)
    clipped = apply_clip(w, bound)
    assert clipped.abs().reshape(8, 4, 16).amax(-1).le(bound + 1e-6).all()
    err = lambda v: float(((x @ pseudo_quantize(v, spec).T - x @ w.T) ** 2).mean())  # noqa: E731
    assert err(clipped) <= err(w) + 1e-9


# --------------------------------------------------------------------------- folding


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt_neox"])
def test_folding_preserves_the_layer_output(kind):
    model = tiny_model(kind)
    arch = arch_for(model)
    layer = decoder_layers(model)[0]
    ids = torch.randint(0, 384, (2, 16))
    with torch.no_grad():
        for p in layer.parameters():  # non-trivial norm weights and biases
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
        ref = model(ids).logits
    folded = 0
    gen = torch.Generator().manual_seed(0)
    for group in arch.smooth:
        prev, linears = get_module(layer, group.prev), [get_module(layer, n) for n in group.linears]
        if fold_problem(prev, linears):
            continue
        s = torch.rand(linears[0].in_features, generator=gen) * 3 + 0.2
        fold_scales(prev, linears, s, arch.norm_offset)
        folded += 1
    with torch.no_grad():
        got = model(ids).logits
    assert folded == len(arch.smooth) - (1 if kind != "gpt_neox" else 0)  # v->o skipped under GQA
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gqa_value_to_output_group_is_not_foldable():
    layer = decoder_layers(tiny_model("llama"))[0]
    problem = fold_problem(layer.self_attn.v_proj, [layer.self_attn.o_proj])
    assert problem and "grouped-query" in problem
    mha = decoder_layers(tiny_model("llama", num_key_value_heads=4))[0]
    assert fold_problem(mha.self_attn.v_proj, [mha.self_attn.o_proj]) is None


# --------------------------------------------------------------------------- the stage


def _quantize(model_dir, out, data, method="awq", **stage):
    recipe = recipe_from_stage(str(model_dir), {"type": "quantize", "method": method, **stage},
                               {"data": str(data), "samples": 4, "seq_len": 48}, "test")
    loaded = load_model(str(model_dir))
    report = run_recipe(recipe, out, RunOptions(device=CPU), loaded=loaded)
    return loaded.model, report


def _outlier_model_dir(tmp_path):
    """A tiny Llama whose norms make a few input channels of every linear 20x larger (as in real LLMs)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[5, 40]] *= 20.0
            layer.mlp.up_proj.weight[[7, 90]] *= 10.0
    path = save_tiny(tmp_path / "outliers")
    model.save_pretrained(path)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_awq_beats_rtn_on_outlier_channels(tmp_path, text_file):
    path = _outlier_model_dir(tmp_path)
    awq, _ = _quantize(path, tmp_path / "awq", text_file, bits=3, group_size=32, format="dense")
    rtn = load_model(str(path)).model
    ref = load_model(str(path)).model
    spec = QuantSpec(3, 32, sym=False)
    with torch.no_grad():
        for layer in rtn.model.layers:
            for name in arch_for(rtn).linears:
                lin = get_module(layer, name)
                lin.weight.data = rtn_quantize(lin.weight.data, spec).dequantize()
    ids = torch.randint(0, 384, (4, 48), generator=torch.Generator().manual_seed(5))
    base = _logits(ref, ids)
    err_awq = float(((_logits(awq, ids) - base) ** 2).mean())
    err_rtn = float(((_logits(rtn, ids) - base) ** 2).mean())
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


def test_saved_search_reapplies_to_identical_weights(tiny_dir, text_file, tmp_path):
    first, report = _quantize(tiny_dir, tmp_path / "a", text_file, group_size=32, format="dense")
    meta = json.loads((tmp_path / "a" / "awq_search" / "awq_search.json").read_text())
    assert meta["num_layers"] == 2 and meta["bits"] == 4 and meta["model_type"] == "llama"
    layer0 = report["stages"][0]["result"]["layers"][0]
    assert "skipped" in layer0["self_attn.v_proj->"]  # GQA in the tiny Llama
    assert 0 <= layer0["input_layernorm->"]["alpha"] < 1
    again, report2 = _quantize(tiny_dir, tmp_path / "b", text_file, group_size=32, format="dense",
                               search_results=str(tmp_path / "a"))
    assert report2["stages"][0]["result"]["search"] == "reapplied"
    for (name, p), q in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
    from safetensors.torch import load_file

    saved_a = load_file(str(tmp_path / "a" / "awq_search" / "awq_search.safetensors"))
    saved_b = load_file(str(tmp_path / "b" / "awq_search" / "awq_search.safetensors"))
    assert saved_a.keys() == saved_b.keys() and any(".clip." in k for k in saved_a)


@pytest.mark.parametrize("kind", ["gemma", "gpt_neox", "qwen3"])
def test_other_architectures_save_and_load(kind, tmp_path, text_file):
    path = save_tiny(tmp_path / kind, kind)
    model, report = _quantize(path, tmp_path / "out", text_file, group_size=32)
    back = load_model(str(tmp_path / "out"))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(back.model, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    assert report["export"]["format"] == "awq"


def test_awq_gptq_runs_and_stays_close(tiny_dir, text_file, tmp_path):
    model, report = _quantize(tiny_dir, tmp_path / "out", text_file, method="awq+gptq", group_size=32)
    back = load_model(str(tmp_path / "out"))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(back.model, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    assert report["stages"][0]["result"]["quantized_modules"] == 14


def test_cli_errors_are_one_line(tiny_dir, text_file, tmp_path):
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--method", "awq", "--bits", "3",
                              "--group-size", "32", "--data", str(text_file)])
    assert res.exit_code == 2 and "4-bit" in res.output and "compressed-tensors" in res.output
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "y"), "--method", "awq",
                              "--group-size", "48", "--data", str(text_file)])
    assert res.exit_code == 2 and "group size" in res.output
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "z"), "--method", "awq",
                              "--group-size", "32", "--search-results", str(tmp_path / "nope"), "--data", str(text_file)])
    assert res.exit_code == 2 and "do not exist" in res.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("stage", [{"bits": 3, "format": "compressed-tensors"}, {"bits": 4, "format": "dense"},
                                   {"bits": 4, "format": "awq", "zero_point": False, "clip": False}])
def test_other_formats_load_back_to_the_quantized_model(tiny_dir, text_file, tmp_path, stage):
    model, report = _quantize(tiny_dir, tmp_path / "out", text_file, group_size=32, **stage)
    back = load_model(str(tmp_path / "out"))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(back.model, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    assert report["export"]["format"].split(":")[0] == stage["format"]  # compressed-tensors:pack-quantized
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "awq_search" / "awq_search.safetensors"))
    assert any(".clip." in k for k in saved) == stage.get("clip", True)
    assert any(".smooth." in k for k in saved)
