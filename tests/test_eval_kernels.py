"""`eval` times what users run: packed models through torch's int4 kernel (bf16 activations) with the
baseline also timed in bf16, the reference path never timed, and the table says which kernel ran."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.eval.api import EvalSetup, evaluate
from geminicompress.eval.table import kernel_label, markdown_table, same_dtype_lines
from geminicompress.eval.config import EvalStage
from geminicompress.runtime.pipeline import RunOptions

FAST = dict(type="eval", seq_len=64, max_tokens=256, prompt_len=8, gen_len=3, batch_sizes=[1], repeats=1, warmup=0)
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def models(tmp_path_factory, text_file):
    from tiny import save_tiny

    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    root = tmp_path_factory.mktemp("evalkernels")
    base = save_tiny(root / "base")
    out = {}
    for name, stage in {"gptq": {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 32},
                        "rtn8": {"type": "quantize", "method": "rtn", "bits": 8, "group_size": 32}}.items():
        recipe = recipe_from_stage(str(base), stage, {"data": str(text_file), "samples": 4, "seq_len": 64}, "test")
        run_recipe(recipe, root / name, RunOptions(device=torch.device("cpu"), stream=False), loaded=load_model(str(base)))
        out[name] = str(root / name)
    return str(base), out


def test_packed_model_runs_the_int4_kernel_beside_a_bf16_baseline(models, text_file):
    base, out = models
    report = evaluate([out["gptq"]], base, str(text_file), None, EvalStage(**FAST), setup=EvalSetup(device=torch.device("cpu")))
    names = [m["name"] for m in report["models"]]
    assert names == ["base", "base @bfloat16", "gptq"]
    ref, bf16, gptq = report["models"]
    assert ref["kernel"]["kernel"] == "dense" and ref["dtype"] == "float32"
    assert bf16["dtype_baseline"] and bf16["dtype"] == "bfloat16" and bf16["latency"] is not None
    assert gptq["kernel"]["kernel"] == "torch-int4-cpu" and gptq["dtype"] == "bfloat16"
    assert gptq["kernel"]["modules"] == {"torch-int4-cpu": 14}
    assert gptq["latency"]["tpot_ms"]["median"] > 0
    assert kernel_label(gptq) == "int4, bf16" and kernel_label(bf16) == "dense, bf16"
    assert "int4, bf16" in markdown_table(report)
    lines = same_dtype_lines(report)
    assert len(lines) == 1 and lines[0].startswith("gptq: TPOT ") and "base @bfloat16's" in lines[0]
    # quality is measured through the kernel too: the bf16 fast path against the fp32 dequantized weights
    assert gptq["quality"]["perplexity"] > 0 and gptq["quality"]["kl_to_baseline"] is not None


def test_reference_path_is_never_timed(models, text_file):
    base, out = models
    opts = EvalStage(**{**FAST, "kernels": "reference"})
    report = evaluate([out["gptq"]], base, str(text_file), None, opts, setup=EvalSetup(device=torch.device("cpu")))
    assert [m["name"] for m in report["models"]] == ["base", "gptq"]  # no bf16 row: nothing runs in bf16
    gptq = report["models"][1]
    assert gptq["latency"] is None and gptq["kernel"]["kernel"] == "reference" and gptq["dtype"] == "float32"
    assert any("latency not measured" in n for n in gptq["notes"])
    assert gptq["quality"]["perplexity"] > 0


def test_fast_and_reference_perplexity_agree(models, text_file):
    base, out = models
    got = {}
    for kernels in ("fast", "reference"):
        opts = EvalStage(**{**FAST, "kernels": kernels, "latency": False})
        got[kernels] = evaluate([out["gptq"]], base, str(text_file), None, opts, setup=EvalSetup(device=torch.device("cpu")))["models"][-1]["quality"]["perplexity"]
    assert got["fast"] == pytest.approx(got["reference"], rel=5e-3)


def test_8bit_groups_have_no_kernel_and_no_made_up_latency(models, text_file):
    base, out = models
    report = evaluate([out["rtn8"]], base, str(text_file), None, EvalStage(**FAST), setup=EvalSetup(device=torch.device("cpu")))
    assert [m["name"] for m in report["models"]] == ["base", "rtn8"]
    rtn8 = report["models"][1]
    assert rtn8["latency"] is None and kernel_label(rtn8) == "no 8-bit kernel, dequantized once, fp32"
    assert any("8-bit linears with groups or zero points have no kernel on cpu" in n for n in rtn8["notes"])
    assert rtn8["quality"]["perplexity"] > 0


def test_cli_kernels_and_dtype_baseline_flags(models, text_file, tmp_path):
    base, out = models
    common = [out["gptq"], "--baseline", base, "--data", str(text_file), "--seq-len", "64", "--max-tokens", "256",
              "--prompt-len", "8", "--gen-len", "3", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0",
              "--threads", "1"]
    r = runner.invoke(app, ["eval", *common, "-o", str(tmp_path / "a"), "--no-dtype-baseline"])
    assert r.exit_code == 0, r.output
    assert [m["name"] for m in json.loads((tmp_path / "a" / "report.json").read_text())["models"]] == ["base", "gptq"]
    r = runner.invoke(app, ["eval", *common, "-o", str(tmp_path / "b"), "--kernels", "fastest"])
    assert r.exit_code == 2 and "--kernels" in r.output and len(r.output.strip().splitlines()) == 1


def test_a_kept_baseline_is_measured_once_and_gives_the_same_figures(models, text_file, monkeypatch):
    """Within `baseline_kept()` (tune's rounds) the baseline is evaluated by the first call only; later calls
    reuse its entry and cached log-probs, and every model's figures equal those of a fresh run."""
    from geminicompress.eval import api

    base, out = models
    options = EvalStage(**{**FAST, "latency": False})
    fresh = evaluate([out["gptq"]], base, str(text_file), None, options, setup=EvalSetup(device=torch.device("cpu")))
    loaded = []
    real = api.load_model
    monkeypatch.setattr(api, "load_model", lambda spec, **kw: loaded.append(spec) or real(spec, **kw))
    with api.baseline_kept():
        first = evaluate([out["gptq"]], base, str(text_file), None, options, setup=EvalSetup(device=torch.device("cpu")))
        again = evaluate([out["rtn8"], out["gptq"]], base, str(text_file), None, options,
                         setup=EvalSetup(device=torch.device("cpu")))
    assert loaded == [base, out["gptq"], out["rtn8"], out["gptq"]]  # the baseline loaded once
    for report in (first, again):
        assert report["models"][0]["quality"] == fresh["models"][0]["quality"]
        assert report["models"][-1]["quality"] == fresh["models"][1]["quality"]
    assert again["models"][1]["quality"]["kl_to_baseline"] > 0
