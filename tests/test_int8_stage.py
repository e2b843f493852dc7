"""The int8 / w8a8 stage on a tiny Llama: accuracy against fp32, the on-disk format, round trip, CLI errors."""

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.int8.config import Int8Stage
from geminicompress.engine.contract import StageContext
from geminicompress.eval.engines.torch_kernels import use_fast_kernels
from geminicompress.formats.bits import unpack_bits
from geminicompress.formats.dequant import DequantLinear
from geminicompress.kernels.int8 import Int8WeightOnlyLinear, W8A8Linear
from geminicompress.models.loading import load_model
from geminicompress.host.progress import NullProgress
from geminicompress.runtime.recipes.schema import Recipe
from geminicompress.runtime.stages import run_stage
from geminicompress.runtime.pipeline import RunOptions

runner = CliRunner()


def _ctx(model, tok, tmp_path):
    recipe = Recipe(model="tiny", stages=[{"type": "quantize", "method": "w8a8"}])
    windows = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(0))
    ctx = StageContext(model, tok, None, recipe, NullProgress(), torch.device("cpu"), tmp_path, tmp_path)
    ctx.calibration = lambda data=None, samples=None, seq_len=None: windows
    return ctx


def _logit_errors(model, reference, ids):
    with torch.no_grad():
        a, b = model(ids).logits, reference(ids).logits
    return float((a - b).norm() / b.norm()), float((a.argmax(-1) == b.argmax(-1)).float().mean())


# Measured on this random tiny model: relative error 0.020 (int8), 0.027 (w8a8, with or without SmoothQuant).
@pytest.mark.parametrize("method,alpha,tolerance", [("int8", None, 0.03), ("w8a8", None, 0.04), ("w8a8", 0.5, 0.04)])
def test_logits_stay_close_to_fp32(method, alpha, tolerance, tok, tmp_path):
    """Tolerance: ||Δlogits|| / ||logits|| over 2 x 32 tokens, and >= 85% of the fp32 top-1 tokens kept."""
    from tiny import tiny_model

    reference, model = tiny_model(), tiny_model()
    ctx = _ctx(model, tok, tmp_path)
    summary = run_stage(Int8Stage(method=method, smoothquant_alpha=alpha), ctx)[1]
    cls = W8A8Linear if method == "w8a8" else Int8WeightOnlyLinear
    assert sum(isinstance(m, cls) for m in model.modules()) == summary["quantized"] == 14
    assert summary["kept_float"] == {"lm_head": "ignore 'lm_head'"}
    assert len(summary["layers"]) == 14 and all(l["weight_rel_error"] < 0.01 for l in summary["layers"])
    assert summary["smoothquant"].get("folded_groups", 0) == (6 if alpha is not None else 0)
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    relative_error, top1_agreement = _logit_errors(model, reference, ids)
    assert relative_error < tolerance
    assert top1_agreement >= 0.85


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_save_load_round_trip_is_identical(method, tok, tmp_path):
    from tiny import save_tiny

    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    src = save_tiny(tmp_path / "src")
    recipe = recipe_from_stage(str(src), {"type": "quantize", "method": method}, {"samples": 4, "seq_len": 64}, "test")
    loaded_src = load_model(str(src))
    report = run_recipe(recipe, tmp_path / "out", RunOptions(device=torch.device("cpu"), verify=False), loaded=loaded_src)
    model = loaded_src.model  # the model in memory after the stage
    assert report["export"]["quantized_linears"] == 14
    loaded = load_model(str(tmp_path / "out"))
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(2))
    if method == "int8":  # pack-quantized 8-bit: read back as codes (the reference path), run by eval on fbgemm
        assert loaded.format == "compressed-tensors:pack-quantized"
        assert isinstance(loaded.model.model.layers[1].mlp.down_proj, DequantLinear)
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
        assert use_fast_kernels(loaded.model, torch.device("cpu")).kernel == "fbgemm-fp16-codes"
    else:
        assert loaded.format == "compressed-tensors:int-quantized"
    cls = W8A8Linear if method == "w8a8" else Int8WeightOnlyLinear
    assert isinstance(loaded.model.model.layers[1].mlp.down_proj, cls)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


def _quantized(model_dir, out, method: str) -> dict:
    """`quantize MODEL -o OUT --method METHOD` through the CLI; OUT's quantization_config."""
    res = runner.invoke(app, ["quantize", str(model_dir), "-o", str(out), "--method", method, "--quiet"])
    assert res.exit_code == 0, res.output
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_checkpoint_layout_is_compressed_tensors_int_quantized(tiny_dir, tmp_path):
    out = tmp_path / "w8a8"
    qc = _quantized(tiny_dir, out, "w8a8")
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "int-quantized", ["lm_head"])
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["dynamic"]) == (8, "int", True, "channel", False)
    assert (a["num_bits"], a["type"], a["symmetric"], a["strategy"], a["dynamic"]) == (8, "int", True, "token", True)
    with safe_open(out / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        assert q.dtype == torch.int8 and q.shape == (64, 64) and s.shape == (64, 1)
        assert int(q.abs().max()) == 127 and int(q.min()) >= -127
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert not any(k.endswith("zero_point") for k in f.keys())
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][0]["result"]["quantized"] == 14
    # SmoothQuant is on by default, calibrated on the recipe's calibration data (builtin:pydoc)
    smoothing = report["stages"][0]["result"]["smoothquant"]
    assert (smoothing["alpha"], smoothing["data"], smoothing["folded_groups"]) == (0.5, "builtin:pydoc", 6)
    assert smoothing["calibration_windows"] == 128 and smoothing["seq_len"] == 512


def test_weight_only_int8_is_pack_quantized_8bit_as_vllm_reads_it(tiny_dir, tmp_path):
    """W8A16 as compressed-tensors writes weight-only integers (vLLM's config asserts on int-quantized
    without input activations): pack-quantized 8-bit per channel, the same codes plus 128."""
    out = tmp_path / "int8"
    qc = _quantized(tiny_dir, out, "int8")
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    group = qc["config_groups"]["group_0"]
    assert (group["format"], group["input_activations"], group["targets"]) == ("pack-quantized", None, ["Linear"])
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"], w["actorder"]) == \
        (8, "int", True, "channel", None, None)
    model = load_model(str(tiny_dir)).model
    with safe_open(out / "model.safetensors", "pt") as f:
        name = "model.layers.0.self_attn.q_proj"
        packed, scale = f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_scale")
        assert packed.dtype == torch.int32 and packed.shape == (64, 16) and scale.shape == (64, 1)
        assert f.get_tensor(f"{name}.weight_shape").tolist() == [64, 64]
        assert not any(k.endswith(("zero_point", "g_idx")) or k == f"{name}.weight" for k in f.keys())
        codes = unpack_bits(packed, 8, 64) - 128  # the int8 module's codes, symmetric in [-127, 127]
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    expected = Int8WeightOnlyLinear.from_linear(model.model.layers[0].self_attn.q_proj)
    assert torch.equal(codes.to(torch.int8), expected.weight)
    torch.testing.assert_close(scale, expected.weight_scale)


def test_smoothquant_defaults_and_how_to_turn_it_off():
    assert Int8Stage(method="w8a8").smoothquant_alpha == 0.5
    assert Int8Stage(method="int8").smoothquant_alpha is None
    assert Int8Stage(method="w8a8", smoothquant_alpha=None).smoothquant_alpha is None  # `smoothquant_alpha: null`
    assert Int8Stage(method="w8a8", smoothquant_alpha=0).smoothquant_alpha is None  # alpha 0 = off
    assert Int8Stage(method="int8", smoothquant_alpha=0).smoothquant_alpha is None


def test_cli_smoothquant_alpha_0_turns_it_off(tiny_dir, tmp_path):
    out = tmp_path / "w8a8"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", "w8a8", "--smoothquant-alpha", "0",
                              "--quiet"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    assert result["smoothquant"] == {"alpha": None}
    assert all(layer["smoothquant_max_scale"] is None for layer in result["layers"])


def test_weight_only_declares_no_activation_quantization(tiny_dir, tmp_path):
    out = tmp_path / "int8"
    qc = _quantized(tiny_dir, out, "int8")
    assert qc["config_groups"]["group_0"]["input_activations"] is None


@pytest.mark.parametrize("args,message", [
    (["--method", "int8", "--bits", "4"], "bits"),
    (["--method", "w8a8", "--bits", "16"], "bits"),
    (["--method", "w8a8", "--smoothquant-alpha", "1.5"], "smoothquant_alpha"),
    (["--method", "w8a8", "--smoothquant-alpha", "-0.1"], "smoothquant_alpha"),
    (["--method", "int8", "--smoothquant-alpha", "0.5"], "w8a8 only"),
    (["--method", "w8a8", "--ignore", "lm_head", "--ignore", "no_such_layer"], "no_such_layer"),
    (["--method", "w8a8", "--ignore", "(unclosed"], "regular expression"),
    (["--method", "w8a8", "--ignore", "."], "no linear layer"),
])
def test_bad_options_are_one_line_exit_2_nothing_written(args, message, tiny_dir, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--quiet", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists() and not list(tmp_path.glob(".*partial"))
