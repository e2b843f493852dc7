"""`serve-bench`: the workload (shared prefix, distinct questions, Poisson arrivals, truncation), the
transformers serving loop's bookkeeping (hits, agreement), the rows with their reasons, a workload longer
than the context refused before any model loads, and the vLLM rows' jobs on the stand-in vllm package."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.core.errors import InputError
from geminicompress.eval.serving import table as serve_table
from geminicompress.eval.serving.bench import ServeOptions, serve_bench
from geminicompress.eval.serving.hf import HFFlags, serve
from geminicompress.eval.serving.rows import ROWS, hf_rows, vllm_rows
from geminicompress.eval.serving.servers import Models, vllm_job
from geminicompress.eval.serving.workload import WorkloadSpec, arrivals, build_workload, check_spec
from geminicompress.runtime.pipeline import RunOptions

runner = CliRunner()
FAKE = Path(__file__).parent / "fake_vllm"
SMALL = WorkloadSpec(requests=6, prefix_len=32, question_len=16, answer_len=4)


pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_workload_shares_the_prefix_and_cuts_distinct_questions():
    ids = torch.arange(1000)
    reqs, repeated = build_workload(ids, WorkloadSpec(requests=4, prefix_len=10, question_len=5, answer_len=3, rate=2))
    assert repeated == 0 and all(r.prefix == list(range(10)) for r in reqs)
    assert [r.question for r in reqs] == [list(range(10 + 5 * i, 15 + 5 * i)) for i in range(4)]
    assert reqs[0].arrival_s == 0.0 and all(a.arrival_s < b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert reqs[1].prompt(12) == list(range(10)) + [18, 19]  # prefix kept, the question's end kept
    _, repeated = build_workload(torch.arange(20), WorkloadSpec(requests=4, prefix_len=10, question_len=5))
    assert repeated == 2


def test_arrivals_are_poisson_and_seeded():
    a = arrivals(2000, 4.0, seed=3)
    assert a == arrivals(2000, 4.0, seed=3) and a != arrivals(2000, 4.0, seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrivals(3, 0.0, 0) == [0.0, 0.0, 0.0]


def test_workload_checks_before_any_model_loads():
    with pytest.raises(InputError, match=r"needs 448 tokens per request .* more than the model's context of 256"):
        check_spec(WorkloadSpec(prefix_len=256, question_len=128, answer_len=64), 256)
    with pytest.raises(InputError, match="--max-prompt-len 300 must keep the 256-token prefix"):
        check_spec(WorkloadSpec(prefix_len=256, question_len=32, max_prompt_len=300), None)
    with pytest.raises(InputError, match="--rate"):
        check_spec(WorkloadSpec(rate=-1), None)
    with pytest.raises(InputError, match="--rate must be > 0"):
        check_spec(WorkloadSpec(rate=0), None)


def test_cli_workload_longer_than_context_is_one_line_exit_2(tiny_dir, tmp_path, monkeypatch):
    import geminicompress.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    r = runner.invoke(app, ["serve-bench", str(tiny_dir), "-o", str(tmp_path / "out"), "--prefix-len", "400",
                            "--question-len", "100", "--answer-len", "32"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "more than the model's context of 512" in lines[0]
    assert not (tmp_path / "out").exists()


def test_serving_loop_hits_and_same_answers_across_rows(model):
    reqs, _ = build_workload(torch.arange(1, 400), SMALL)
    results = {}
    for name, flags in {"plain": HFFlags(), "sdpa": HFFlags("sdpa"), "reuse": HFFlags("sdpa", prefix_cache=True),
                        "batch": HFFlags("sdpa", prefix_cache=True, max_batch=4),
                        "paged": HFFlags("sdpa", prefix_cache=True, max_batch=4, paged=True)}.items():
        results[name] = serve(model, reqs, flags, SMALL.truncated_len, SMALL.prefix_len, warmup=False)
    plain = [t.tokens for t in results["plain"]]
    for name, timings in results.items():
        assert [len(t.tokens) for t in timings] == [4] * 6 and all(t.generated == 4 for t in timings)
        assert all(t.ttft >= 0 and t.finished >= t.arrival for t in timings)
        same = sum(a == b for t, p in zip(timings, plain) for a, b in zip(t.tokens, p))
        assert same >= 0.9 * 24, name  # the same greedy answers, up to float rounding of near ties
    assert [t.cached_tokens for t in results["plain"]] == [0] * 6
    assert [t.cached_tokens for t in results["reuse"]] == [0] + [32] * 5  # the first request computes the prefix
    assert [t.cached_tokens for t in results["batch"]] == [0] + [32] * 5  # one batch of 4, then 2 reusing it
    # paged: the burst's first 4 are prefilled together (no block complete yet), the last 2 share their blocks
    assert [t.cached_tokens for t in results["paged"]][4:] == [32, 32]
    trunc = serve(model, reqs, HFFlags(truncate=True), SMALL.truncated_len, SMALL.prefix_len, warmup=False)
    assert all(t.prompt_tokens == SMALL.truncated_len == 40 for t in trunc)
    for flags in (HFFlags("sdpa", prefix_cache=True, max_batch=4), HFFlags("sdpa", prefix_cache=True, max_batch=4, paged=True)):
        alone = serve(model, reqs[:3], flags, SMALL.truncated_len, SMALL.prefix_len, warmup=False, concurrency=1)
        # one after another: each arrives once the one before has finished, and finds the prefix cached
        assert all(b.arrival >= a.finished for a, b in zip(alone, alone[1:])), flags
        assert [t.cached_tokens for t in alone][1:] == [32, 32] and [t.tokens for t in alone] == plain[:3], flags
    for flags in (HFFlags("sdpa", max_batch=4), HFFlags("sdpa", max_batch=4, paged=True)):
        closed = serve(model, reqs, flags, SMALL.truncated_len, SMALL.prefix_len, warmup=False, concurrency=2)
        # two clients: requests 0 and 1 at once, each later one when the one two before it has finished
        assert [t.arrival for t in closed[:2]] == [0.0, 0.0], flags
        assert all(closed[i].arrival >= closed[i - 2].finished - 1e-3 for i in range(2, 6)), flags
        assert [t.tokens for t in closed] == plain, flags


def test_rows_keep_their_reasons():
    hf = hf_rows(8, {})
    assert [r.name for r in hf] == list(ROWS)
    assert hf[4].flags == {"max_batch": 8} and hf[9].flags["draft"] and hf[9].flags["max_batch"] == 1
    assert [r.model for r in hf[6:9]] == ["int8", "int4", "student"]
    assert all(r.reason is None for r in hf[:6]) and all(r.reason for r in hf[6:])
    assert "--int8" in hf[6].reason and "--int4" in hf[7].reason and "--student" in hf[8].reason
    assert "--draft" in hf[9].reason
    assert all(r.reason is None for r in hf_rows(8, {"int8": "a", "int4": "b", "student": "c", "draft": "d"}))
    cpu = vllm_rows(8, {"int8": "x"}, on_cuda=False)
    assert "one attention backend" in cpu[2].reason and "paged in every row" in cpu[5].reason
    assert cpu[4].flags == {"max_num_seqs": 8} and cpu[6].reason is None
    assert "not wired" in vllm_rows(8, {"draft": "d"}, on_cuda=False)[9].reason
    gpu = vllm_rows(8, {}, on_cuda=True)
    assert gpu[2].reason is None and gpu[2].flags["attention_backend"] == "FLASH_ATTN"
    assert gpu[0].flags["attention_backend"] == "TRITON_ATTN"


def test_vllm_job_of_a_row():
    reqs, _ = build_workload(torch.arange(1, 400), SMALL)
    flags = {"enable_prefix_caching": True, "max_num_seqs": 1, "truncate": True}
    job = vllm_job(flags, "/m", reqs, SMALL, torch.zeros(2, 64, dtype=torch.long), "auto", with_ppl=True)
    assert job["engine"]["enable_prefix_caching"] is True and job["engine"]["max_num_seqs"] == 1
    assert "truncate" not in job["engine"] and job["engine"]["max_model_len"] == 32 + 16 + 4 + 16 + 12
    serve_task, lp = job["tasks"]
    assert [len(r["prompt"]) for r in serve_task["requests"]] == [40] * 6 and lp["kind"] == "logprobs"
    alone = vllm_job(flags, "/m", reqs[:3], SMALL, None, "auto", with_ppl=False, alone=True)["tasks"]
    assert [len(t["requests"]) for t in alone] == [1, 1, 1] and [t["reset_prefix_cache"] for t in alone] == [True, False, False]


def test_serve_bench_end_to_end_in_process(tiny_dir, text_file, tmp_path):
    from tiny import save_tiny

    student = save_tiny(tmp_path / "student", num_hidden_layers=1)
    spec = WorkloadSpec(requests=4, prefix_len=32, question_len=16, answer_len=3)
    # the model as its own draft: every proposed token accepted, the verifier's answers exactly
    report = serve_bench(Models(str(tiny_dir), student=str(student), draft=str(tiny_dir)), str(text_file), spec,
                         ServeOptions(max_batch=2, ppl_tokens=1024))
    rows = {r["row"]: r for r in report["rows"]}
    assert [r["row"] for r in report["rows"]] == list(ROWS)
    assert rows["INT8 (W8A8)"]["metrics"] is None and rows["INT4 (GPTQ)"]["metrics"] is None
    measured = [r for r in report["rows"] if r["metrics"]]
    assert len(measured) == 8 and all(r["alone"]["requests"] == 3 for r in measured)
    assert measured[0]["answer_agreement"] == 1.0 and measured[0]["perplexity"] > 1 and measured[0]["mark"] == "stack"
    assert rows["KV-cache reuse"]["metrics"]["cached_tokens"] == 3 * 32  # the first request computes the prefix
    assert rows["distilled student"]["ppl_drift"] is not None and rows["distilled student"]["model"] == "student"
    spec_row = rows["speculative decoding"]
    assert spec_row["divergences"]["requests"] == 0 and spec_row["verifier_agreement"] == 1.0 and spec_row["acceptance"]["accepted"] == spec_row["acceptance"]["proposed"] > 0
    load = report["load"]
    assert load["share"] == 0.7 and load["rate_req_s"] == pytest.approx(0.7 * load["stack_capacity_req_s"], rel=1e-3)
    assert rows[load["stack"]]["mark"] in ("stack", "stacked")
    serve_table.write(report, tmp_path / "rep")
    md = (tmp_path / "rep" / "serving.md").read_text()
    assert "not measured: no W8A8 model given" in md and (tmp_path / "rep" / "serving.png").stat().st_size > 10_000
    assert "accepted per verification step" in md and "TTFT ms alone" in md
    assert json.loads((tmp_path / "rep" / "serving.json").read_text())["rows"][0]["row"] == "original configuration"


def test_serve_bench_vllm_rows_on_the_stand_in(tiny_dir, text_file, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    spec = WorkloadSpec(requests=3, prefix_len=32, question_len=16, answer_len=3)
    refused = shutil.copytree(tiny_dir, tmp_path / "refuse-int8")
    report = serve_bench(Models(str(tiny_dir), int8=str(refused)), str(text_file), spec,
                         ServeOptions(engine="vllm", max_batch=2, ppl_tokens=512, vllm_python=sys.executable))
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["original configuration"]["metrics"]["ttft_ms"]["median"] == 250.0
    assert rows["original configuration"]["perplexity"] > 1 and rows["original configuration"]["alone"]
    assert "one attention backend" in rows["FlashAttention"]["reason"] and rows["FlashAttention"]["metrics"] is None
    assert rows["KV-cache reuse"]["metrics"]["kv_hit_rate"] > 0
    assert rows["INT8 (W8A8)"]["reason"].startswith("vLLM refused it: AssertionError")
    assert rows["speculative decoding"]["metrics"] is None
    with pytest.raises(InputError, match="does not exist"):
        serve_bench(Models(str(tiny_dir), int8=str(tmp_path / "nothing")), str(text_file), spec)


@pytest.mark.parametrize("args, message", [
    (["--rate", "0"], "--rate must be > 0"),
    (["--rate", "2", "--load", "0.5"], "both set"),
    (["--load", "1"], "between 0 and 1"),
    (["--concurrency", "2", "--rate", "1"], "--rate and --concurrency both set"),
    (["--student", "{big}"], "larger than its teacher"),
    (["--draft", "{vocab}"], "vocabulary of 500 tokens"),
    (["--int4", "{tiny}"], "not a 4-bit"),
])
def test_cli_bad_input_is_one_line_exit_2_before_any_model_loads(tiny_dir, tmp_path_factory, tmp_path, monkeypatch,
                                                                 args, message):
    import geminicompress.models.loading as loading
    from tiny import save_tiny

    made = tmp_path_factory.getbasetemp() / "serve-bad"
    if not made.exists():
        save_tiny(made / "big", num_hidden_layers=3)
        save_tiny(made / "vocab", vocab_size=500)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    args = [a.format(big=made / "big", vocab=made / "vocab", tiny=tiny_dir) for a in args]
    r = runner.invoke(app, ["serve-bench", str(tiny_dir), "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.output
    assert not (tmp_path / "out").exists()


def test_recipe_eval_stage_builds_the_serving_table_with_the_w8a8_output(tiny_dir, text_file, tmp_path):
    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import validate

    recipe = validate({"model": str(tiny_dir), "calibration": {"data": str(text_file), "samples": 2, "seq_len": 64},
                       "stages": [{"type": "quantize", "method": "w8a8"},
                                  {"type": "eval", "latency": False, "seq_len": 64, "max_tokens": 256,
                                   "serving": {"requests": 3, "prefix_len": 32, "question_len": 16, "answer_len": 3,
                                               "max_batch": 2, "ppl_tokens": 512}}]}, "test")
    report = run_recipe(recipe, tmp_path / "out", RunOptions(device=torch.device("cpu"), stream=False), loaded=load_model(str(tiny_dir)))
    serving = report["stages"][1]["result"]["serving"]
    assert serving["report"] == "eval/serving/serving.json"
    saved = json.loads((tmp_path / "out" / "eval" / "serving" / "serving.json").read_text())
    assert saved["int8"] == str(tmp_path / "out") and saved["int4"] is None and saved["student"] is None
    int8 = next(r for r in saved["rows"] if r["row"] == "INT8 (W8A8)")
    assert int8["metrics"] is not None and int8["ppl_drift"] is not None and int8["alone"] is not None
    assert serving["rows"]["INT8 (W8A8)"]["mark"] in ("stacked", "lost", "trade")
    with pytest.raises(Exception, match="serving.rate|rate"):
        validate({"model": str(tiny_dir), "stages": [{"type": "eval", "serving": {"rate": 0}}]}, "test")
    with pytest.raises(Exception, match="serving.load|load"):
        validate({"model": str(tiny_dir), "stages": [{"type": "eval", "serving": {"load": 1.5}}]}, "test")
    with pytest.raises(Exception, match="requets|extra"):
        validate({"model": str(tiny_dir), "stages": [{"type": "eval", "serving": {"requets": 3}}]}, "test")


def test_logit_gap_where_an_answer_leaves_the_verifiers(tiny_dir):
    from geminicompress.eval.serving.servers import HFServer

    reqs, _ = build_workload(torch.arange(1, 400), SMALL)
    server = HFServer(Models(str(tiny_dir)), SMALL, None, "auto", False)
    model = server.need(["base"])[0][0]
    reference = [t.tokens for t in serve(model, reqs[:2], HFFlags(), SMALL.truncated_len, SMALL.prefix_len, warmup=False)]
    other = [reference[0], reference[1][:2] + [(reference[1][2] + 1) % 384, 0]]
    gaps = server.logit_gaps({}, reqs, reference, other, [(1, 2)])
    logits = model(input_ids=torch.tensor([reqs[1].prompt() + reference[1][:2]])).logits[0, -1]
    assert gaps == [pytest.approx(float(logits[reference[1][2]] - logits[other[1][2]]), abs=1e-5)] and gaps[0] > 0
    server.close()
    assert server.loaded == {}


def test_llama_rows_say_what_llama_cpp_cannot_switch():
    from geminicompress.eval.serving.llama_server import llama_rows

    rows = llama_rows({"draft": "d"})
    assert [r.name for r in rows] == list(ROWS)
    assert "one sequence at a time" in rows[4].reason and "unified buffer" in rows[5].reason
    assert rows[2].flags == {"flash_attn": True} and rows[3].flags == {"reuse": True} and rows[9].reason is None
    assert "--int8" in rows[6].reason


@pytest.mark.slow
def test_serve_bench_in_real_llama_cpp(tiny_dir, text_file):
    """The tiny model as an F32 GGUF in real llama.cpp, as its own draft: the prompt cache hits, every proposal
    accepted, the verifier's answers exactly."""
    from test_llama_engine import REAL

    if not Path(REAL).is_file() or os.system(f"{REAL} -c 'import llama_cpp' 2>/dev/null") != 0:
        pytest.skip("llama-cpp-python is not installed")
    spec = WorkloadSpec(requests=3, prefix_len=32, question_len=16, answer_len=6)
    report = serve_bench(Models(str(tiny_dir), draft=str(tiny_dir)), str(text_file), spec,
                         ServeOptions(engine="llama.cpp", llama_python=REAL, ppl_tokens=512, capacity_requests=3))
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["original configuration"]["metrics"]["cached_tokens"] == 0
    assert rows["KV-cache reuse"]["metrics"]["cached_tokens"] == 2 * 32 and rows["original configuration"]["perplexity"] > 1
    assert rows["dynamic batching"]["metrics"] is None
    spec_row = rows["speculative decoding"]
    assert spec_row["acceptance"]["accepted"] == spec_row["acceptance"]["proposed"] > 0
    assert spec_row["answer_agreement"] == 1.0
