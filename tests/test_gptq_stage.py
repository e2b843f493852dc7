"""The GPTQ stage on tiny models: save -> load gives the in-memory quantized model; bad input fails early."""

import json

import pytest
import torch
from tiny import save_tiny, tiny_tokenizer
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.core.arch import arch_for, get_module
from geminicompress.core.grid import QuantizedWeight, QuantSpec, rtn_quantize
from geminicompress.formats.dequant import DequantLinear
from geminicompress.models.loading import load_model, resolve_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _quantize(model_dir, out, data, **stage):
    recipe = recipe_from_stage(str(model_dir), {"type": "quantize", "method": "gptq", **stage},
                               {"data": str(data), "samples": 6, "seq_len": 64}, "test")
    loaded = load_model(str(model_dir))
    report = run_recipe(recipe, out, RunOptions(device=CPU), loaded=loaded)
    return loaded.model, report


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("fmt,stage", [
    ("gptq", {"bits": 4, "group_size": 32}),
    ("gptq", {"bits": 3, "group_size": -1, "sym": False, "act_order": "group"}),
    ("gptq", {"bits": 2, "group_size": 32, "act_order": "group", "true_sequential": False}),
    ("gptq", {"bits": 4, "group_size": 32, "act_order": "none"}),
    ("compressed-tensors", {"bits": 4, "group_size": 32, "sym": False}),
    ("compressed-tensors", {"bits": 4, "group_size": 32, "act_order": "group"}),
    ("compressed-tensors", {"bits": 8, "group_size": -1, "act_order": "group"}),
    ("dense", {"bits": 4, "group_size": 16}),
])
def test_saved_checkpoint_loads_back_to_the_quantized_model(tiny_dir, text_file, tmp_path, fmt, stage):
    out = tmp_path / "out"
    model, report = _quantize(tiny_dir, out, text_file, format=fmt, **stage)
    back = load_model(str(out))
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(back.model, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    q_proj = back.model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, DequantLinear) == (fmt != "dense")
    assert not isinstance(back.model.lm_head, DequantLinear)  # ignored by default
    result = report["stages"][0]["result"]
    assert result["quantized_modules"] == 14 and len(result["layers"]) == 2
    assert all(layer["err"] > 0 for layer in result["layers"])
    # every quantized weight lies on its grid: at most 2^bits distinct values per row and group
    w = q_proj.weight if fmt != "dense" else q_proj.weight.data
    group = stage["group_size"] if stage["group_size"] > 0 else 64
    if stage.get("act_order", GPTQStage.model_fields["act_order"].default) != "group":
        assert len(torch.unique(w[0, :group])) <= 2 ** stage["bits"]


def test_gptq_beats_rtn_on_the_model_output(tiny_dir, text_file, tmp_path):
    from geminicompress.data.windows import calibration_windows

    model, _ = _quantize(tiny_dir, tmp_path / "out", text_file, bits=3, group_size=-1, format="dense")
    rtn = load_model(str(tiny_dir)).model
    ref = load_model(str(tiny_dir)).model
    with torch.no_grad():
        for name in arch_for(rtn).linears:
            for layer in rtn.model.layers:
                lin = get_module(layer, name)
                lin.weight.data = rtn_quantize(lin.weight.data, QuantSpec(3, -1)).dequantize()
    ids = calibration_windows(tiny_tokenizer(), str(text_file), 4, 64, seed=1)
    target = _logits(ref, ids)
    err_gptq = float(((_logits(model, ids) - target) ** 2).mean())
    err_rtn = float(((_logits(rtn, ids) - target) ** 2).mean())
    assert err_gptq < err_rtn


def test_gptq_config_and_tensors_follow_the_v1_layout(tiny_dir, text_file, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    _quantize(tiny_dir, out, text_file, bits=4, group_size=32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
    assert json.loads((out / "quantize_config.json").read_text())["bits"] == 4
    t = load_file(str(out / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"  # (out 64, in 128)
    assert t[f"{prefix}.qweight"].shape == (128 * 4 // 32, 64) and t[f"{prefix}.qweight"].dtype == torch.int32
    assert t[f"{prefix}.qzeros"].shape == (4, 64 * 4 // 32) and t[f"{prefix}.scales"].shape == (4, 64)
    assert t[f"{prefix}.scales"].dtype == torch.float16 and t[f"{prefix}.g_idx"].shape == (128,)
    # the default (act-order static): no permutation for a loader to apply, as vLLM requires with desc_act false
    assert torch.equal(t[f"{prefix}.g_idx"], torch.arange(128, dtype=torch.int32) // 32)
    assert f"{prefix}.weight" not in t and "lm_head.weight" in t


def test_ignore_keeps_modules_in_float_and_lists_them(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    _quantize(tiny_dir, out, text_file, format="compressed-tensors", group_size=32, ignore=["lm_head", r"mlp\.down_proj"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    back = load_model(str(out)).model
    assert isinstance(back.model.layers[1].mlp.down_proj, torch.nn.Linear)
    assert isinstance(back.model.layers[1].mlp.up_proj, DequantLinear)


@pytest.mark.parametrize("kind", ["qwen2", "gpt_neox"])
def test_other_architectures(tmp_path, text_file, kind):
    """Biases (qwen2, gpt_neox) and a fused qkv (gpt_neox) survive packing."""
    src = save_tiny(tmp_path / kind, kind)
    model, _ = _quantize(src, tmp_path / "out", text_file, group_size=32)
    back = load_model(str(tmp_path / "out")).model
    ids = torch.randint(0, 384, (1, 30))
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)


def test_resume_restores_finished_layers(tiny_dir, text_file, tmp_path):
    from geminicompress.engine.contract import StageContext
    from geminicompress.host.progress import NullProgress
    from geminicompress.runtime.stages import run_stage

    recipe = recipe_from_stage(str(tiny_dir), {"type": "quantize", "method": "gptq", "group_size": 32},
                               {"data": str(text_file), "samples": 4, "seq_len": 64}, "test")
    results = []
    for _ in range(2):
        loaded = load_model(str(tiny_dir))
        ctx = StageContext(loaded.model, loaded.tokenizer, resolve_model(str(tiny_dir)), recipe, NullProgress(),
                           CPU, tmp_path, tmp_path / "state")
        (tmp_path / "state").mkdir(exist_ok=True)
        results.append((run_stage(recipe.stages[0], ctx)[1], loaded.model))
    (first, a), (second, b) = results
    assert all(layer.get("resumed") for layer in second["layers"])
    assert second["total_error"] == first["total_error"]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("extra,message", [
    (["--bits", "6"], "bits"),
    (["--group-size", "48"], "group size 48 does not divide"),
    (["--samples", "1", "--calib-seq-len", "16"], "calibration tokens"),
    (["--ignore", ".*"], "no linear layer left"),
    (["--ignore", "("], "regular expression"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_dir, text_file, tmp_path, extra, message):
    out = tmp_path / "out"
    res = _cli("quantize", tiny_dir, "-o", out, "--method", "gptq", "--data", text_file, "--quiet", "--group-size", "32", *extra)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_cli_writes_gptq_with_a_report(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    res = _cli("quantize", tiny_dir, "-o", out, "--method", "gptq", "--bits", "4", "--group-size", "32",
               "--data", text_file, "--samples", "4", "--calib-seq-len", "64", "--quiet")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["export"]["format"] == "gptq" and report["export"]["quantized_modules"] == 14
    assert load_model(str(out)).format == "gptq"


def test_act_order_group_still_writes_compressed_tensors_and_warns_in_one_line(tiny_dir, text_file, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    res = _cli("quantize", tiny_dir, "-o", out, "--method", "gptq", "--group-size", "32", "--act-order", "group",
               "--format", "compressed-tensors", "--data", text_file, "--samples", "4", "--calib-seq-len", "64", "--quiet")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.output.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "vLLM refuses" in warnings[0]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    assert "model.layers.0.mlp.down_proj.weight_g_idx" in load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("act_order,actorder", [("static", "weight"), ("none", None)])
def test_servable_act_orders_write_no_g_idx_in_compressed_tensors(tiny_dir, text_file, tmp_path, act_order, actorder):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    _quantize(tiny_dir, out, text_file, bits=4, group_size=32, act_order=act_order, format="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == actorder  # vLLM refuses only "group"
    assert not [k for k in load_file(str(out / "model.safetensors")) if k.endswith("g_idx")]


def test_recipes_from_before_the_choice_keep_their_meaning():
    def cfg(**kw):
        return GPTQStage(method="gptq", **kw).act_order

    assert cfg() == "static"
    assert cfg(act_order=True) == "group" and cfg(act_order=False) == "none"
    assert cfg(act_order=True, static_groups=True) == "static" and cfg(static_groups=False) == "static"
    with pytest.raises(ValueError, match="act_order"):
        GPTQStage(method="gptq", act_order="weight")


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_bfloat16_calibration_keeps_float32_weights_on_the_grid_and_matches_float32_quality(tmp_path, text_file, kind):
    """calib_dtype bfloat16: layers compute in bf16 while calibrating, but the model comes back float32,
    every weight is exactly the dequantized code the export writes, and the output error is about the
    float32 calibration's (GPTQ's error feedback turns bf16 noise into different roundings of many
    weights, so codes are not compared one by one) and below round-to-nearest's."""
    from geminicompress.data.windows import calibration_windows

    src = save_tiny(tmp_path / kind, kind)
    ref, _ = _quantize(src, tmp_path / "f32", text_file, bits=3, group_size=-1, format="gptq")
    model, _ = _quantize(src, tmp_path / "bf16", text_file, bits=3, group_size=-1, format="gptq",
                         calib_dtype="bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    back = load_model(str(tmp_path / "bf16")).model  # dequantized from the packed codes
    ids = calibration_windows(tiny_tokenizer(), str(text_file), 4, 64, seed=1)
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    rtn = load_model(str(src)).model
    with torch.no_grad():
        for name, module in rtn.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.data = rtn_quantize(module.weight.data, QuantSpec(3, -1)).dequantize()
    target = _logits(load_model(str(src)).model, ids)
    err = {k: float(((_logits(m, ids) - target) ** 2).mean()) for k, m in [("f32", ref), ("bf16", model), ("rtn", rtn)]}
    assert err["bf16"] < 1.25 * err["f32"] and err["bf16"] < err["rtn"]


@pytest.mark.parametrize("bits,in_f", [(2, 8), (3, 10), (4, 6), (4, 5), (8, 6)])
def test_kept_codes_round_trip_through_nibble_packing(bits, in_f):
    """Codes kept between layers (two per byte up to 4 bits) come back identical at export."""
    from geminicompress.core.grid import KeptCodes, keep_codes

    q = torch.randint(0, 2 ** bits, (7, in_f), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    g_idx = torch.zeros(in_f, dtype=torch.int32)
    qw = QuantizedWeight(q, torch.ones(7, 1), torch.zeros(7, 1, dtype=torch.int32), g_idx, QuantSpec(bits, -1))
    kept = keep_codes(qw, "m")
    packed = bits <= 4 and in_f % 2 == 0
    assert kept["m.q"].shape == (7, in_f // 2 if packed else in_f)
    assert torch.equal(KeptCodes(kept, {"m": ("m", qw.spec)})["m"].q.to(torch.int32), q)


def test_auto_group_size_is_the_largest_that_divides_every_layer():
    from geminicompress.core.grid import auto_group_size
    from geminicompress.core.errors import InputError

    assert auto_group_size([576, 1536]) == 64  # SmolLM2-135M: 128 does not divide 576
    assert auto_group_size([2048, 8192]) == 128
    assert auto_group_size([96, 256]) == 32
    with pytest.raises(InputError, match=r"input features \(48, 64\); pass --group-size"):
        auto_group_size([64, 48])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_default_group_size_fits_the_model_and_is_reported(tmp_path, text_file, method):
    # hidden 96, MLP 192: the old default 128 divides neither; auto picks 32 and says so.
    model_dir = save_tiny(tmp_path / "m", hidden_size=96, intermediate_size=192, num_attention_heads=4)
    out = tmp_path / "out"
    res = _cli("quantize", model_dir, "-o", out, "--method", method, "--data", text_file,
               "--samples", "4", "--calib-seq-len", "64")
    assert res.exit_code == 0, res.output
    assert "group size 32 (auto" in res.output
    stage = json.loads((out / "report.json").read_text())["stages"][0]
    assert stage["options"]["group_size"] == "auto"
    assert stage["result"]["group_size"] == 32 and stage["result"]["group_size_auto"] is True
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 32


def _linear_zeros(path) -> dict[str, float]:
    model = load_model(str(path), dtype=torch.float32).model
    return {n: float((m.weight == 0).float().mean()) for n, m in model.named_modules()
            if ".layers." in n and n.endswith("proj")}


@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_quantizing_a_pruned_model_keeps_its_zeros_when_asked(tiny_dir, text_file, tmp_path, method):
    """`--keep-zeros`: a 50%-pruned model stays at least as sparse per linear after GPTQ; by default GPTQ's
    error feedback moves pruned weights off zero in every linear."""
    pruned = tmp_path / "pruned"
    assert _cli("prune", tiny_dir, "-o", pruned, "--sparsity", "0.5", "--quiet").exit_code == 0
    before = _linear_zeros(pruned)
    assert len(before) == 14 and min(before.values()) > 0.3
    after = {}
    for flags in ([], ["--keep-zeros"]):
        out = tmp_path / ("keep" if flags else "default")
        res = _cli("quantize", pruned, "-o", out, "--method", method, "--bits", "4", "--group-size", "32", *flags,
                   "--data", text_file, "--samples", "4", "--calib-seq-len", "64", "--quiet")
        assert res.exit_code == 0, res.output
        after[out.name] = _linear_zeros(out)
        assert json.loads((out / "report.json").read_text())["stages"][0]["options"]["keep_zeros"] == bool(flags)
    assert all(after["keep"][n] >= before[n] for n in before)
    assert all(after["default"][n] < before[n] for n in before)  # measured: 0.3-4.8 pp fewer zeros per linear
