"""Mixed-precision GPTQ on a tiny Llama: per-module overrides and budgeted allocation, written as GPTQ
(`dynamic`) and compressed-tensors (several config groups), loaded back by our loader."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.core.arch import get_module
from geminicompress.core.grid import QuantSpec
from geminicompress.formats.dequant import DequantLinear
from geminicompress.formats.mixed import ct_spec_of, dynamic_spec
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
runner = CliRunner()
V = "model.layers.0.self_attn.v_proj"


def quantize(model_dir, out, data, **stage):
    recipe = recipe_from_stage(str(model_dir), {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16,
                                                **stage}, {"data": str(data), "samples": 6, "seq_len": 64}, "test")
    loaded = load_model(str(model_dir))
    report = run_recipe(recipe, out, RunOptions(device=CPU), loaded=loaded)
    return loaded.model, report["stages"][0]["result"]


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_forced_8bit_module_is_8bit_on_disk_and_round_trips(tiny_dir, text_file, tmp_path, fmt):
    out = tmp_path / fmt
    model, summary = quantize(tiny_dir, out, text_file, format=fmt, overrides={V: "b8g16"})
    assert summary["mixed"] == {"b4g16": 13, "b8g16": 1}
    tensors = load_file(str(out / "model.safetensors"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    base = QuantSpec(4, 16, True)
    if fmt == "gptq":
        assert tensors[f"{V}.qweight"].shape == (64 * 8 // 32, 32)  # (in·b/32, out): 8 bits per code
        assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (64 * 4 // 32, 64)
        assert qc["bits"] == 4 and dynamic_spec(qc["dynamic"], V, base) == QuantSpec(8, 16, True)
        assert dynamic_spec(qc["dynamic"], "model.layers.0.self_attn.q_proj", base) == base
        # GPTQModel.load reads the overrides from quantize_config.json (transformers' GPTQConfig has none)
        assert json.loads((out / "quantize_config.json").read_text())["dynamic"] == qc["dynamic"]
    else:
        assert tensors[f"{V}.weight_packed"].shape == (32, 64 * 8 // 32)  # (out, in·b/32)
        assert len(qc["config_groups"]) == 2
        assert ct_spec_of(qc["config_groups"], V) == QuantSpec(8, 16, True)
        assert ct_spec_of(qc["config_groups"], "model.layers.1.mlp.up_proj") == base
    loaded = load_model(str(out)).model
    v = get_module(loaded, V)
    assert isinstance(v, DequantLinear) and v.bits == 8
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)
    for name, module in loaded.named_modules():  # every module's weights equal the in-memory fake-quantized ones
        if isinstance(module, DequantLinear):
            torch.testing.assert_close(module.weight.float(), get_module(model, name).weight.float(), rtol=0, atol=1e-6)


def test_target_bits_allocation_meets_budget_and_writes_frontier(tiny_dir, text_file, tmp_path):
    out = tmp_path / "alloc"
    _, summary = quantize(tiny_dir, out, text_file, format="gptq",
                          allocation={"options": ["gptq:b4g16", "gptq:b2g16"], "target_bits": 3.4})
    a = summary["allocation"]
    assert a["average_bits"] <= 3.4 + 1e-9
    assert a["average_bits"] > (2 + 18 / 16)  # spends the budget: not all at 2 bits
    modules = json.loads((out / "allocation.json").read_text())["modules"]
    assert set(modules.values()) == {"b4g16", "b2g16"}
    assert (out / "allocation_frontier.png").stat().st_size > 1000
    loaded = load_model(str(out)).model
    for name, label in modules.items():
        assert get_module(loaded, name).bits == int(label[1])


@pytest.mark.parametrize("args, needle", [
    (["--target-bits", "9"], "--target-bits 9 bits per weight cannot be met with these options: the reachable range is"),
    (["--target-bits", "3.5", "--allocation-options", "gptq:b4g48,gptq:b3g16"], "group size 48 does not divide"),
    (["--target-bits", "3.5", "--allocation-options", "awq:b4g16"], "gptq:b<bits>g<group>"),
    (["--target-bits", "3.5", "--max-drift", "2%"], "exactly one of"),
    (["--max-drift", "two"], "positive percentage"),
])
def test_bad_budget_one_line_nothing_written(tiny_dir, text_file, tmp_path, args, needle):
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "-q", "--method", "gptq", "--group-size", "16",
                              "--data", str(text_file), "--samples", "4", "--calib-seq-len", "32",
                              "--allocation-options", "gptq:b4g16,gptq:b3g16", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("{not json", "is not a sensitivity.json")])
def test_bad_sensitivity_table_one_line(tiny_dir, text_file, tmp_path, content, needle):
    table = tmp_path / "sensitivity.json"
    if content is not None:
        table.write_text(content)
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "-q", "--method", "gptq", "--group-size", "16",
                              "--data", str(text_file), "--samples", "4", "--calib-seq-len", "32",
                              "--target-bits", "3.5", "--sensitivity", str(table)])
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_tune_allocates_quantizes_and_measures(tiny_dir, text_file, tmp_path):
    out = tmp_path / "tuned"
    res = runner.invoke(app, ["tune", str(tiny_dir), "-o", str(out), "-q", "--max-drift", "50%",
                              "--options", "gptq:b4g16,gptq:b2g16", "--data", str(text_file), "--samples", "4",
                              "--calib-seq-len", "32", "--eval-data", str(text_file), "--eval-tokens", "256",
                              "--eval-seq-len", "64"])
    assert res.exit_code == 0, res.output
    a = json.loads((out / "allocation.json").read_text())
    assert a["predicted_drift_pct"] <= 50
    assert a["measured_drift_pct"] is not None and a["measured_on"] == str(text_file)
    assert a["rounds"][-1]["measured_pct"] == a["measured_drift_pct"] <= 50 and (out / "sensitivity.json").is_file()
    assert [p["bits"] for p in a["frontier"]] == sorted(p["bits"] for p in a["frontier"])
    assert (out / "allocation_frontier.png").stat().st_size > 1000
    assert (out / "eval" / "report.json").is_file()


def _fake_round(measure):
    """A round that writes a checkpoint folder with allocation.json: predicted = what was asked (the knapsack
    spends the budget), measured = measure(predicted), bits falling with the budget."""
    def run_round(asked, table, folder):
        folder.mkdir(parents=True)
        chosen = {"average_bits": round(8 - asked / 2, 3), "predicted_drift_pct": asked, "modules": {},
                  "frontier": [{"bits": 4, "predicted_drift_pct": 1.0}]}
        (folder / "allocation.json").write_text(json.dumps(chosen))
        report = {"stages": [{}, {"result": {"quality": {"ppl_ratio": 1 + measure(asked) / 100}}}]}
        return report, chosen
    return run_round


def test_tune_rounds_correct_the_undercount_they_measure(tmp_path):
    """A proxy that undercounts 2x in KL units: round 1 (asked 5%) measures 10.25%, round 2 asks
    expm1(log1p(5%)/2) = 2.47% and measures 5.0%: under the budget, its checkpoint becomes OUT."""
    import math

    from geminicompress.runtime.tune import run_tune

    twice = lambda p: 100 * math.expm1(2 * math.log1p(p / 100))  # noqa: E731
    lines = []
    chosen = run_tune(_fake_round(twice), tmp_path / "out", 5.0, ["gptq:b4g64"], None, lines.append)
    rounds = chosen["rounds"]
    assert [r["index"] for r in rounds] == [1, 2] and chosen["round"] == 2
    assert rounds[0]["measured_pct"] == pytest.approx(10.25, abs=1e-2)
    assert rounds[1]["asked_pct"] == pytest.approx(100 * math.expm1(math.log1p(0.05) / 2), abs=1e-3)
    assert rounds[1]["measured_pct"] <= 5.0 + 1e-9
    assert json.loads((tmp_path / "out" / "allocation.json").read_text())["measured_drift_pct"] <= 5.0 + 1e-9
    assert len(lines) == 2 and "over the +5% budget" in lines[0] and "under the +5% budget" in lines[1]
    assert not list(tmp_path.glob(".out.tune"))


def test_tune_that_cannot_reach_its_budget_says_so_and_keeps_the_best_beside_out(tmp_path):
    from geminicompress.core.errors import GeminiError
    from geminicompress.runtime.tune import run_tune

    with pytest.raises(GeminiError) as info:
        run_tune(_fake_round(lambda p: 30 + p), tmp_path / "out", 5.0, ["gptq:b8g64"], None, lambda line: None)
    assert info.value.exit_code == 1 and len(str(info.value).splitlines()) == 1
    assert "no allocation of gptq:b8g64 measured under +5%" in str(info.value)
    assert not (tmp_path / "out").exists()
    best = json.loads((tmp_path / "out-best" / "allocation.json").read_text())
    assert best["measured_drift_pct"] == min(r["measured_pct"] for r in best["rounds"])
