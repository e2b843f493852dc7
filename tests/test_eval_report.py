"""`evaluate` on tiny checkpoints: report schema, tokenizer mismatch, bad input lines, CLI, recipe stage."""

import json

import pytest
import torch
from tiny import VOCAB, save_tiny
from typer.testing import CliRunner

from geminicompress.runtime import methods, pipeline
from geminicompress.cli import app
from geminicompress.eval.api import evaluate
from geminicompress.models import load_model
from geminicompress.eval.config import EvalStage
from geminicompress.runtime.recipes.schema import Recipe
import stage_for_tests

FAST = dict(type="eval", seq_len=64, max_tokens=640, prompt_len=8, gen_len=3, batch_sizes=[1, 2], repeats=2, warmup=0)
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread_module")


class Lines:
    """A Progress that records warnings."""

    def __init__(self):
        self.warnings = []

    def task(self, description, total):
        from geminicompress.host.progress import NullProgress

        return NullProgress().task(description, total)

    def info(self, message):
        pass

    def warn(self, message):
        self.warnings.append(message)


def other_tokenizer():
    """A BPE with the same vocabulary size trained on other text: different merges, different ids."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator([topics[k] for k in sorted(topics)][-40:], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = save_tiny(root / "base")
    same = save_tiny(root / "noisy", seed=1)
    other = save_tiny(root / "othertok", seed=2)
    other_tokenizer().save_pretrained(other)
    return base, same, other


@pytest.fixture(scope="module")
def report(dirs, text_file):
    base, same, other = dirs
    lines = Lines()
    rep = evaluate([str(base), str(same), str(other)], str(base), str(text_file), None, EvalStage(**FAST), lines)
    rep["_warnings"] = lines.warnings
    return rep


def test_report_has_the_listed_keys(report):
    assert {"machine", "versions", "options", "models", "baseline"} <= set(report)
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch_threads"] == torch.get_num_threads()
    assert [m["name"] for m in report["models"]] == ["base", "noisy", "othertok"]  # baseline given twice, once
    for m in report["models"]:
        assert {"name", "path", "quality", "latency", "peak_memory_mb", "size_mb", "params", "sparsity"} <= set(m)
        assert {"perplexity", "tokens", "kl_to_baseline", "top1_agreement"} <= set(m["quality"])
        assert set(m["latency"]["ttft_ms"]) == {"median", "p90"} and set(m["latency"]["tpot_ms"]) == {"median", "p90"}
        assert set(m["latency"]["throughput_tok_s"]) == {"1", "2"}
        assert m["params"] == 123_200 and m["sparsity"] == 0.0 and m["size_mb"] > 0
    base = report["models"][0]
    assert base["quality"]["kl_to_baseline"] == 0.0 and base["quality"]["top1_agreement"] == 1.0
    assert base["quality"]["tokens"] == 10 * 63  # 640 tokens -> 10 windows of 64 -> 63 scored each


def test_drift_of_a_different_model(report):
    noisy = report["models"][1]["quality"]
    assert noisy["kl_to_baseline"] > 0.01 and 0.0 <= noisy["top1_agreement"] < 1.0
    assert noisy["ppl_ratio"] == pytest.approx(noisy["perplexity"] / report["models"][0]["quality"]["perplexity"], rel=1e-5)


def test_tokenizer_mismatch_skips_only_kl_and_agreement(report):
    other = report["models"][2]
    assert other["quality"]["perplexity"] > 1 and other["latency"] is not None
    assert other["quality"]["kl_to_baseline"] is None and other["quality"]["top1_agreement"] is None
    msgs = [w for w in report["_warnings"] if w.startswith("othertok:")]
    assert len(msgs) == 1 and "tokenizer differs" in msgs[0] and "KL" in msgs[0]
    assert not [w for w in report["_warnings"] if w.startswith("noisy:")]


def test_report_files_and_table(report, tmp_path):
    from geminicompress.eval.report import tradeoff_points, write_report
    from geminicompress.eval.table import markdown_table, summary_line

    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["models"][1]["name"] == "noisy"
    assert (tmp_path / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert markdown_table(report) in md and "tradeoff.png" in md
    line = summary_line(report, report["models"][1])
    assert line.startswith("ppl ") and " KL " in line and "TPOT" in line
    label, points = tradeoff_points(report)
    assert "time per output token" in label and points[0] == ("base", -0.0, 0.0) and len(points) == 3


def invoke(*args):
    return runner.invoke(app, ["eval", *map(str, args)])


CLI_FAST = ["--seq-len", "64", "--max-tokens", "256", "--no-latency", "-q"]


def test_cli_bad_inputs_are_one_line_each_and_others_still_run(dirs, text_file, tmp_path):
    base, same, _ = dirs
    short = tmp_path / "short.txt"
    short.write_text("too short")
    out = tmp_path / "rep"
    res = invoke(base, same, tmp_path / "missing", "--data", text_file, "-o", out, *CLI_FAST)
    assert res.exit_code == 1, res.output  # a model it was asked to measure failed: a script must see it (#34)
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 3 models failed: missing") and "report.json" in last, last
    lines = [line for line in res.output.splitlines() if "missing" in line and "warning" in line]
    assert len(lines) == 1 and "does not exist" in lines[0]
    rep = json.loads((out / "report.json").read_text())
    assert rep["models"][1]["quality"]["kl_to_baseline"] > 0 and "error" in rep["models"][2]
    assert "noisy" in res.output  # the table

    # text shorter than one window: decided before any model loads, one line, exit 2, nothing written
    res = invoke(base, same, "--data", short, "-o", tmp_path / "r2", *CLI_FAST)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [res.output.strip()]
    assert "fewer than one perplexity window of 64" in res.output and "--no-quality" in res.output
    assert not (tmp_path / "r2").exists()
    # ... unless only latency was asked for
    res = invoke(base, "--data", short, "-o", tmp_path / "r2", "--no-quality", "-q", "--threads", "1",
                 "--prompt-len", "4", "--gen-len", "2", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert rep["models"][0]["quality"] is None and rep["models"][0]["latency"]["tpot_ms"]["median"] > 0

    res = invoke(base, same, "--data", text_file, "-o", tmp_path / "r3", *CLI_FAST, "--seq-len", "1024")
    assert res.exit_code == 0, res.output
    assert sum("above its context of 512" in line for line in res.output.splitlines()) == 2


def test_cli_input_errors_exit_2_before_work(dirs, text_file, tmp_path):
    base, _, _ = dirs
    out = tmp_path / "rep"
    out.mkdir()
    res = invoke(base, "--data", text_file, "-o", out, *CLI_FAST)
    assert res.exit_code == 2 and "--force" in res.output
    res = invoke(base, "--data", text_file, "-o", tmp_path / "x", "--batch-sizes", "1,zero")
    assert res.exit_code == 2 and "--batch-sizes" in res.output
    res = invoke(base, "--data", tmp_path / "nope.txt", "-o", tmp_path / "x")
    assert res.exit_code == 2 and "does not exist" in res.output
    res = invoke(base, "--data", text_file, "-o", tmp_path / "x", "--repeats", "0")
    assert res.exit_code == 2 and "--repeats" in res.output
    res = invoke(tmp_path / "nobase", "--data", text_file, "-o", tmp_path / "x", "-q")
    assert res.exit_code == 2 and res.output.startswith("error: baseline: model directory")
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_cli_draft_and_tasks_degrade_to_one_line(dirs, text_file, tmp_path, monkeypatch):
    import sys

    base, same, _ = dirs
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    monkeypatch.setitem(sys.modules, "geminicompress.eval.speculative", None)
    res = invoke(base, "--data", text_file, "-o", tmp_path / "r", *CLI_FAST, "--tasks", "hellaswag", "--draft", same)
    assert res.exit_code == 0, res.output
    assert sum("lm-eval" in line for line in res.output.splitlines()) == 1
    assert sum("speculative decoding is not available" in line for line in res.output.splitlines()) == 1
    assert json.loads((tmp_path / "r" / "report.json").read_text())["speculative"]["available"] is False


def test_eval_stage_at_the_end_of_a_recipe(dirs, text_file, tmp_path, monkeypatch):
    from geminicompress.runtime.recipes.schema import Recipe

    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(stage_for_tests.zero_first_layer))
    base = dirs[0]
    recipe = Recipe(model=str(base), stages=[{"type": "prune"}, {**FAST, "data": str(text_file), "latency": False}])
    out = tmp_path / "out"
    report = pipeline.run_recipe(recipe, out)
    summary = report["stages"][1]["result"]
    ev = json.loads((out / "eval" / "report.json").read_text())
    assert [m["name"] for m in ev["models"]] == ["base", "out"] and ev["models"][1]["path"] == str(out)
    assert summary["quality"]["kl_to_baseline"] > 0 and summary["summary"].startswith("ppl ")
    assert ev["models"][1]["sparsity"] > 0  # the zeroed q_proj, read back from disk
    assert (out / "eval" / "tradeoff.png").is_file() and (out / "eval" / "report.md").is_file()


FORMATS = [  # (stage module that must exist, command line writing the format)
    ("geminicompress.compress.gptq.stage", ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32"]),
    ("geminicompress.compress.awq.stage", ["quantize", "--method", "awq", "--bits", "4", "--group-size", "32"]),
    ("geminicompress.compress.int8.stage", ["quantize", "--method", "w8a8"]),
    ("geminicompress.compress.prune.stage", ["prune", "--sparsity", "0.5"]),
]


@pytest.mark.parametrize("module,cmd", FORMATS, ids=["gptq", "awq", "w8a8", "prune"])
def test_every_written_format_loads_back_for_eval(module, cmd, dirs, text_file, tmp_path):
    pytest.importorskip(module, reason="that compression stage is not in this checkout yet")
    base = dirs[0]
    out = tmp_path / "compressed"
    res = runner.invoke(app, [cmd[0], str(base), *cmd[1:], "--samples", "4", "--calib-seq-len", "64", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    rep = evaluate([str(out)], str(base), str(text_file), None, EvalStage(**{**FAST, "latency": False}))
    model = rep["models"][1]
    assert "error" not in model and model["notes"] == []
    assert 0 < model["quality"]["kl_to_baseline"] < 1.0 and 0 < model["quality"]["top1_agreement"] < 1.0
    assert model["params"] == rep["models"][0]["params"]  # packed weights count as their logical size
    base_entry = rep["models"][0]
    if cmd[0] == "prune":
        assert model["sparsity"] == pytest.approx(0.5, abs=0.02) and model["quant_zeros"] is None
        # the keep-masks beside the weights are not weights: same dense tensors, same size
        assert model["size_mb"] == pytest.approx(base_entry["size_mb"], rel=1e-3) and model["masks_mb"] > 0
    else:
        assert model["size_mb"] < base_entry["size_mb"] and model["masks_mb"] is None
        # codes that round to zero are not pruning: no sparsity claimed, the zeros reported as what they are
        assert model["sparsity"] is None
        assert 0 < model["quant_zeros"] < (0.05 if cmd[2] == "w8a8" else 0.4)


def test_draft_model_speculative_result_goes_into_the_report(dirs, text_file):
    pytest.importorskip("geminicompress.eval.speculative", reason="the distill helper's module is not here yet")
    base, same, _ = dirs
    opts = EvalStage(**{**FAST, "latency": False, "draft": str(same), "repeats": 1, "gen_len": 4})
    rep = evaluate([], str(base), str(text_file), None, opts)
    spec = rep["speculative"]
    assert spec["available"] is True and spec["draft"] == str(same) and spec["gen_len"] == 4
    assert spec["prompt_len"] == 8 and spec["speedup"] > 0


def test_tasks_results_go_into_each_models_entry(dirs, text_file, monkeypatch):
    """Our plumbing around lm-eval-harness's Python API, with a stand-in module (no hub here)."""
    import sys
    import types

    calls = []
    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = lambda model, tasks: calls.append(tasks) or {
        "results": {t: {"acc,none": 0.25, "alias": t} for t in tasks}}
    models = types.ModuleType("lm_eval.models")
    hf = types.ModuleType("lm_eval.models.huggingface")
    hf.HFLM = lambda pretrained, tokenizer, batch_size, device: ("lm", pretrained)
    for name, mod in {"lm_eval": fake, "lm_eval.models": models, "lm_eval.models.huggingface": hf}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    opts = EvalStage(**{**FAST, "latency": False, "tasks": ["arc_easy"]})
    rep = evaluate([str(dirs[1])], str(dirs[0]), str(text_file), None, opts)
    assert calls == [["arc_easy"], ["arc_easy"]]
    assert all(m["tasks"] == {"arc_easy": {"acc,none": 0.25}} for m in rep["models"])


def test_prune_then_quantize_loads_and_reports_the_pruned_zeros(dirs, text_file, tmp_path):
    """The masks file next to packed weights is neither loaded as weights nor counted in the size; the
    sparsity is the pruned weights that are still zero after quantization."""
    from geminicompress.eval.cost.footprint import prune_masks_path, weight_sparsity, weights_size_mb

    base, out = dirs[0], tmp_path / "pq"
    recipe = Recipe(model=str(base), calibration={"data": str(text_file), "samples": 4, "seq_len": 64},
                    stages=[{"type": "prune", "sparsity": 0.5}, {"type": "quantize", "method": "gptq", "group_size": 32}])
    pipeline.run_recipe(recipe, out)
    model = load_model(str(out)).model
    sparsity = weight_sparsity(model, prune_masks_path(out))
    assert 0.4 < sparsity <= 0.5 and weight_sparsity(model) is None
    assert weights_size_mb(out) == pytest.approx((out / "model.safetensors").stat().st_size / 2**20, abs=0.01)
