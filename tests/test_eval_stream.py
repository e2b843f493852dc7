"""`eval --stream`: perplexity, KL and top-1 agreement of a model read one decoder layer at a time equal
those of the same model loaded in memory (dense and quantized); latency is not measured for it and the
report says why; the choice is automatic when the weights exceed the available memory."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny
from typer.testing import CliRunner

from geminicompress.host import memory
from geminicompress.cli import app
from geminicompress.eval.api import EvalSetup, evaluate
from geminicompress.eval.quality import streamed as streamed_mod
from geminicompress.eval.quality.baseline_cache import BaselineCache
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage
from geminicompress.eval.config import EvalStage

FAST = dict(type="eval", seq_len=64, max_tokens=640, prompt_len=8, gen_len=3, batch_sizes=[1], repeats=1, warmup=0)
QUALITY = ("perplexity", "mean_nll", "kl_to_baseline", "top1_agreement", "ppl_ratio", "tokens", "windows")
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def models(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("evalstream")
    base = save_tiny(root / "base", num_hidden_layers=3)
    noisy = save_tiny(root / "noisy", seed=1, num_hidden_layers=3)
    gptq = root / "gptq"
    recipe = recipe_from_stage(str(base), {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16},
                               {"data": str(text_file), "samples": 6, "seq_len": 64}, "test")
    run_recipe(recipe, gptq, RunOptions(device=torch.device("cpu"), stream=False), loaded=load_model(str(base)))
    return base, noisy, gptq


def quality(report):
    return [{k: m["quality"][k] for k in QUALITY} for m in report["models"]]


def assert_same_quality(a, b):
    for qa, qb in zip(quality(a), quality(b)):
        for k in QUALITY:
            if k in ("tokens", "windows"):
                assert qa[k] == qb[k]
            else:
                assert qa[k] == pytest.approx(qb[k], rel=1e-5, abs=1e-7), k


def test_streamed_quality_equals_in_memory(models, text_file):
    base, noisy, gptq = models
    opts = EvalStage(**{**FAST, "latency": False})
    in_memory = evaluate([str(noisy), str(gptq)], str(base), str(text_file), None, opts, setup=EvalSetup(stream=False))
    streamed = evaluate([str(noisy), str(gptq)], str(base), str(text_file), None, opts, setup=EvalSetup(stream=True))
    assert_same_quality(in_memory, streamed)
    assert [m["streamed"] for m in streamed["models"]] == ["--stream"] * 3
    assert [m["streamed"] for m in in_memory["models"]] == [None] * 3
    assert [m["format"] for m in streamed["models"]] == ["dense", "dense", "gptq"]
    assert [m["params"] for m in streamed["models"]] == [m["params"] for m in in_memory["models"]]
    assert streamed["models"][2]["quality"]["kl_to_baseline"] > 0  # a real comparison, not 0 by accident
    assert all(m["notes"] == [] for m in streamed["models"])  # latency was not asked for: nothing to say


def test_mixed_streamed_and_in_memory_use_one_baseline_cache(models, text_file, monkeypatch):
    """A streamed baseline's cached log-probs serve an in-memory model, and the other way round."""
    import geminicompress.eval.api as api

    base, noisy, _ = models
    opts = EvalStage(**{**FAST, "latency": False})
    reference = evaluate([str(noisy)], str(base), str(text_file), None, opts, setup=EvalSetup(stream=False))
    for one in (str(base), str(noisy)):
        monkeypatch.setattr(api, "stream_reason", lambda spec, stream, dtype, one=one: "test" if spec == one else None)
        report = evaluate([str(noisy)], str(base), str(text_file), None, opts)
        assert [m["streamed"] for m in report["models"]] == ["test" if s == one else None for s in (str(base), str(noisy))]
        assert_same_quality(reference, report)


def test_latency_is_not_measured_for_a_streamed_model_and_the_report_says_why(models, text_file):
    base, _, gptq = models
    report = evaluate([str(gptq)], str(base), str(text_file), None, EvalStage(**FAST), setup=EvalSetup(stream=True))
    for m in report["models"]:
        assert m["latency"] is None and m["tensors_mb"] is None
        assert len(m["notes"]) == 1 and m["notes"][0].startswith("latency and throughput not measured: evaluated one "
                                                                  "layer at a time from disk (--stream)")


def test_automatic_when_the_weights_exceed_available_memory(models, text_file, monkeypatch):
    base, noisy, _ = models
    size = streamed_mod.loaded_bytes(base, torch.float32)
    assert size == pytest.approx(sum(p.numel() for p in load_model(str(base)).model.parameters()) * 4, rel=0.01)
    monkeypatch.setattr(memory, "available_memory", lambda: int(1.9 * size))  # base exceeds half of it (the one rule)
    monkeypatch.setattr(streamed_mod, "available_memory", lambda: int(1.9 * size))
    opts = EvalStage(**{**FAST, "latency": False})
    report = evaluate([str(noisy)], str(base), str(text_file), None, opts)
    assert all(m["streamed"].startswith("its weights take") for m in report["models"])
    report = evaluate([str(noisy)], str(base), str(text_file), None, opts, setup=EvalSetup(stream=False))
    assert all(m["streamed"] is None for m in report["models"])
    monkeypatch.setattr(memory, "available_memory", lambda: int(2.1 * size))
    monkeypatch.setattr(streamed_mod, "available_memory", lambda: int(2.1 * size))
    report = evaluate([str(noisy)], str(base), str(text_file), None, opts)
    assert all(m["streamed"] is None for m in report["models"])


def test_streamed_baseline_without_disk_cache_skips_kl_in_one_note(models, text_file, monkeypatch):
    base, noisy, _ = models
    monkeypatch.setattr(BaselineCache.__init__, "__defaults__", (0,))  # limit_bytes = 0: nothing stored
    report = evaluate([str(noisy)], str(base), str(text_file), None, EvalStage(**{**FAST, "latency": False}),
                      setup=EvalSetup(stream=True))
    q = report["models"][1]["quality"]
    assert q["perplexity"] > 1 and q["kl_to_baseline"] is None
    assert report["models"][1]["notes"][0].startswith("KL and top-1 agreement skipped: the baseline was evaluated "
                                                      "streamed")


def test_cli_stream_flags(models, text_file, tmp_path):
    base, _, gptq = models
    args = ["eval", str(base), str(gptq), "--data", str(text_file), "--seq-len", "64", "--max-tokens", "640",
            "--no-latency", "-q", "--threads", "1"]
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "s"), "--stream"])
    assert res.exit_code == 0, res.output
    streamed = json.loads((tmp_path / "s" / "report.json").read_text())
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "m"), "--no-stream"])
    assert res.exit_code == 0, res.output
    in_memory = json.loads((tmp_path / "m" / "report.json").read_text())
    assert [m["streamed"] for m in streamed["models"]] == ["--stream", "--stream"]
    assert [m["streamed"] for m in in_memory["models"]] == [None, None]
    assert_same_quality(in_memory, streamed)
    # a MODEL that is not a local safetensors directory cannot stream: one line, exit 2, nothing written
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "x"), "--stream", "--baseline", "nobody/not-a-model"])
    assert res.exit_code == 2 and "--stream: nobody/not-a-model is not a local directory" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    res = runner.invoke(app, ["eval", "--help"])
    assert "--stream" in res.output and "--no-stream" in res.output
