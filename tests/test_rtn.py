"""The rtn method (round-to-nearest, no calibration): every 4-bit format round-trips to the in-memory
model, each weight is within half a step of its original, and the CLI reads it from the registry."""

import json

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.formats.dequant import DequantLinear
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")


def _rtn(model_dir, out, **stage):
    recipe = recipe_from_stage(str(model_dir), {"type": "quantize", "method": "rtn", **stage}, {}, "test")
    loaded = load_model(str(model_dir))
    original = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    report = run_recipe(recipe, out, RunOptions(device=CPU), loaded=loaded)
    return loaded.model, original, report


@pytest.mark.parametrize("fmt,stage", [
    ("gptq", {"bits": 4, "group_size": 32}),
    ("gptq", {"bits": 3, "group_size": -1, "sym": False}),
    ("awq", {"bits": 4, "group_size": 32, "sym": False}),
    ("compressed-tensors", {"bits": 4, "group_size": 16, "sym": False}),
    ("compressed-tensors", {"bits": 8, "group_size": -1}),
    ("dense", {"bits": 2, "group_size": 32}),
])
def test_rtn_checkpoint_loads_back_to_the_quantized_model(tiny_dir, tmp_path, fmt, stage):
    out = tmp_path / "out"
    model, original, report = _rtn(tiny_dir, out, format=fmt, **stage)
    back = load_model(str(out))
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert isinstance(back.model.model.layers[0].mlp.up_proj, DequantLinear) == (fmt != "dense")
    assert not isinstance(back.model.lm_head, DequantLinear)  # ignored by default
    # every quantized weight is within half a grid step (plus the fp16 rounding of the scale) of the original
    spec = QuantSpec(stage["bits"], stage["group_size"], stage.get("sym", True))
    name = "model.layers.1.self_attn.o_proj.weight"
    w, w_hat = original[name].float(), dict(model.named_parameters())[name].detach().float()
    ref = rtn_quantize(w, spec)
    step = ref.scales[:, ref.g_idx.long()]
    assert ((w - w_hat).abs() <= step / 2 * 1.01 + 1e-6).all()
    assert report["stages"][0]["result"]["quantized_modules"] == 7 * 2  # 7 linears x 2 layers of the tiny model


def test_rtn_cli_writes_the_gptq_format_by_default(tiny_dir, tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", "rtn", "--bits", "4",
                                   "--group-size", "32", "--quiet"])
    assert res.exit_code == 0, res.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"]) == ("gptq", 4, 32)


def test_rtn_refuses_options_of_other_methods_and_impossible_groups(tiny_dir, tmp_path):
    res = CliRunner().invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "a"), "--method", "rtn", "--act-order", "static"])
    assert res.exit_code == 2 and "does not apply to --method rtn" in res.output
    res = CliRunner().invoke(app, ["quantize", str(tiny_dir), "-o", str(tmp_path / "b"), "--method", "rtn",
                                   "--group-size", "48"])
    assert res.exit_code == 2 and "group size 48 does not divide" in res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
