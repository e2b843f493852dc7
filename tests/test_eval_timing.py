"""Busy-machine detection, the thread default, eval defaults and the duration estimate (issue #16).

Load readings are faked: the tests say what /proc/stat would have shown, never rely on the machine.
"""

import json

import pytest
import torch
from tiny import save_tiny, tiny_config, tiny_model
from typer.testing import CliRunner

from geminicompress.host import threads
from geminicompress.cli import app
from geminicompress.eval.api import evaluate
from geminicompress.eval.cost import contention, latency, plan
from geminicompress.eval.cost.contention import Reading, assess, between
from geminicompress.eval.config import EvalStage
from geminicompress.runtime.recipes.schema import Recipe

CPU = torch.device("cpu")
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


def fake_reader(other_cores: float, own_cores: float = 1.0):
    """Readings as if other processes kept `other_cores` busy while this one used `own_cores`."""
    clock = {"t": 0.0}

    def read() -> Reading:
        clock["t"] += 1.0
        t = clock["t"]
        return Reading(wall=t, busy=t * (other_cores + own_cores), own=t * own_cores, load_1m=1.0 + other_cores)

    return read


# --------------------------------------------------------------------------- contention


def test_between_subtracts_our_own_cpu_time():
    got = between(Reading(10.0, 100.0, 40.0, 0.5), Reading(12.0, 104.5, 42.0, 1.5))  # 2 s, 4.5 busy, 2 ours
    assert got == {"seconds": 2.0, "other_cores": 1.25, "load_1m": 1.5}


def test_quiet_machine_is_reliable():
    v = assess({"batch 1": {"other_cores": 0.05, "load_1m": 1.0}}, {"TPOT": 1.05, "TTFT": None}, cores=2, threads=2)
    assert not v["unreliable"] and v["why"] is None and v["fix"] is None and v["spread"] == 1.05


def test_oversubscribed_cores_suggest_fewer_threads():
    v = assess({"batch 1": {"other_cores": 1.0, "load_1m": 3.1}}, {"TPOT": 1.1}, cores=2, threads=2)
    assert v["unreliable"] and v["oversubscribed"]
    assert v["why"] == "other processes used 1.0 of 2 cores while timing with 2 threads, load average 3.1"
    assert v["fix"] == "rerun with --threads 1 or on a quiet machine"


def test_busy_but_not_oversubscribed_still_warns():
    v = assess({"batch 1": {"other_cores": 0.9, "load_1m": None}}, {}, cores=2, threads=1)
    assert v["unreliable"] and not v["oversubscribed"] and v["fix"] == "rerun on a quiet machine"


def test_spread_runs_are_unreliable_and_small_loads_on_big_machines_are_not():
    v = assess({"b": {"other_cores": 0.0, "load_1m": 0.1}}, {"TTFT": 1.1, "TPOT": 1.6}, cores=2, threads=2)
    assert v["unreliable"] and v["why"] == "TPOT p90 is 1.60x its median" and "--repeats" in v["fix"]
    v = assess({"b": {"other_cores": 0.6, "load_1m": 9.0}}, {"TPOT": 1.0}, cores=64, threads=8)
    assert not v["unreliable"]


def test_measure_latency_records_the_load_of_every_timed_section(monkeypatch, model, tok, text_file):
    from geminicompress.data import tokenize

    monkeypatch.setattr(contention, "read", fake_reader(other_cores=1.0))
    monkeypatch.setattr(latency, "usable_cores", lambda: 2)
    ids = tokenize(tok, text_file.read_text(), 100)
    got = latency.measure_latency(model, ids, latency.LatencyOptions(prompt_len=8, gen_len=3, batch_sizes=(1, 2),
                                                                     repeats=2, warmup=1), device=CPU)
    load = got["load"]
    assert set(load["sections"]) == {"batch 1", "batch 2"}
    assert load["sections"]["batch 1"]["other_cores"] == pytest.approx(1.0)
    assert load["unreliable"] and load["cores"] == 2 and load["threads"] == 1
    assert "other processes used 1.0 of 2 cores" in load["why"]


# --------------------------------------------------------------------------- threads


def test_median_tpot_is_the_median_decode_time_per_token_after_the_untimed_warmups(monkeypatch):
    decode = iter([9.0, 0.3, 0.1, 0.2])  # the warm-up's 9 s must not count
    calls = []

    def fake_run(model, prompt, gen_len, device):
        calls.append(gen_len)
        return latency.RunTiming(prefill_s=5.0, decode_s=next(decode), generated=torch.zeros(1, gen_len))

    monkeypatch.setattr(latency, "greedy_run", fake_run)
    tpot = latency.median_tpot(None, torch.zeros(1, 4, dtype=torch.long), 11, CPU, warmup=1)
    assert calls == [11] * 4
    assert tpot == pytest.approx(0.2 / 10)  # median decode time over gen_len - 1 tokens, no prefill


def test_auto_threads_leaves_the_busy_cores_alone():
    assert threads.auto_threads(2, 2, others=1.0, load_1m=1.3)[0] == 1
    assert threads.auto_threads(2, 2, others=0.1, load_1m=2.0)[0] == 2
    assert threads.auto_threads(2, 2, others=1.9, load_1m=0.2)[0] == 2  # a burst, not a sustained load
    assert threads.auto_threads(8, 8, others=3.0, load_1m=3.0)[0] == 5
    assert threads.auto_threads(2, 2, others=5.0, load_1m=5.0)[0] == 1  # never 0
    n, reason = threads.auto_threads(2, 2, others=1.0, load_1m=1.3)
    assert reason.startswith("1 torch thread: other processes kept 1.0 of 2 cores busy")


def test_choose_threads_precedence(monkeypatch):
    monkeypatch.setattr(threads, "other_busy_cores", lambda seconds=0: 0.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "torch_default_threads", lambda: 4)
    assert threads.choose_threads(3, 2).threads == 3 and threads.choose_threads(3, 2).source == "--threads"
    assert threads.choose_threads(None, 2).threads == 2 and threads.choose_threads(None, 2).source == "recipe"
    auto = threads.choose_threads(None, None)
    assert auto.source == "auto" and auto.threads == 4


def test_other_busy_cores_reads_proc_stat():
    assert 0.0 <= threads.other_busy_cores(0.05) <= threads.usable_cores() + 0.5


def test_recipe_threads_key_is_validated():
    assert Recipe(model="m", stages=[{"type": "prune"}], threads=1).threads == 1
    with pytest.raises(Exception, match="threads"):
        Recipe(model="m", stages=[{"type": "prune"}], threads=0)


def test_threads_option_applies_before_work(tiny_dir, tmp_path, monkeypatch):
    from geminicompress.runtime import methods

    import stage_for_tests

    seen = {}

    def spy(cfg, ctx):
        seen["threads"] = torch.get_num_threads()
        return stage_for_tests.zero_first_layer(cfg, ctx)

    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(spy))
    torch.set_num_threads(2)
    res = runner.invoke(app, ["prune", str(tiny_dir), "-o", str(tmp_path / "out"), "-q", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert seen["threads"] == 1 and "1 torch thread (--threads)" in res.output


# --------------------------------------------------------------------------- defaults and plan


def test_latency_defaults_follow_the_device():
    cpu = plan.with_device_defaults(EvalStage(type="eval"), CPU)
    assert (cpu.prompt_len, cpu.gen_len, cpu.batch_sizes, cpu.repeats) == (128, 32, [1, 4], 3)
    gpu = plan.with_device_defaults(EvalStage(type="eval", repeats=2), torch.device("cuda"))
    assert (gpu.prompt_len, gpu.gen_len, gpu.batch_sizes, gpu.repeats) == (512, 128, [1, 4, 8], 2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_config_params_counts_a_llama_shaped_model(kind):
    cfg = tiny_config(kind)
    exact = sum(p.numel() for p in tiny_model(kind).parameters())
    assert plan.config_params(cfg.to_dict()) == pytest.approx(exact, rel=1e-3)  # qwen3's q/k norms left out
    if kind == "llama":
        assert plan.config_params(cfg.to_dict()) == exact


def test_estimate_matches_the_fitted_demo_figures():
    opts = plan.with_device_defaults(EvalStage(type="eval", latency=False), CPU)
    # perplexity: 2 x 134.5M FLOPs per token at 45 GFLOP/s per thread, 2 threads -> 3.0 ms per token
    assert plan.estimate_seconds(134_515_008, 1, 1000, opts, CPU, 2) == pytest.approx(2.99, abs=0.01)
    opts = plan.with_device_defaults(EvalStage(type="eval", quality=False, batch_sizes=[1], warmup=0, repeats=1), CPU)
    # one run: 128 prompt tokens (0.38 s) + 31 decode steps of 67 ms (x1.1)
    assert plan.estimate_seconds(134_515_008, 1, 0, opts, CPU, 2) == pytest.approx(0.383 + 31 * 0.0673 * 1.1, rel=0.01)
    assert plan.describe_duration(40) == "~40 s" and plan.describe_duration(600) == "~10 min"


def test_evaluate_warns_once_and_marks_busy_timings(monkeypatch, tmp_path, text_file):
    from geminicompress.eval.report import markdown_report
    from geminicompress.eval.table import rows

    monkeypatch.setattr(contention, "read", fake_reader(other_cores=1.0))
    monkeypatch.setattr(latency, "usable_cores", lambda: 2)
    base = save_tiny(tmp_path / "base")
    other = save_tiny(tmp_path / "other", seed=1)
    lines = []

    class Lines:
        def task(self, description, total):
            from geminicompress.host.progress import NullProgress

            return NullProgress().task(description, total)

        def info(self, message):
            lines.append(("info", message))

        def warn(self, message):
            lines.append(("warn", message))

    opts = EvalStage(type="eval", seq_len=64, max_tokens=256, prompt_len=8, gen_len=3, batch_sizes=[1], repeats=2,
                     warmup=0)
    rep = evaluate([str(other)], str(base), str(text_file), None, opts, Lines())
    assert lines[0][0] == "info" and lines[0][1].startswith("plan: 2 models; perplexity on 256 tokens; latency:")
    assert "expected ~" in lines[0][1]
    warns = [m for kind, m in lines if kind == "warn"]
    assert warns == [rep["timing_warning"]]
    assert warns[0].startswith("timings unreliable for base, other (marked *): other processes used 1.0 of 2 cores")
    for row in rows(rep):
        assert row[4][0].endswith("*") and row[5][0].endswith("*") and row[6][0].endswith("*")
        assert not row[1][0].endswith("*")  # perplexity is not a timing
    assert "**Warning:** timings unreliable" in markdown_report(rep)
    json.dumps(rep)


def test_short_text_fails_before_any_model_loads(monkeypatch, tmp_path, tiny_dir):
    from geminicompress.core.errors import InputError
    from geminicompress.eval import api

    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(InputError, match="fewer than one perplexity window of 64"):
        evaluate([str(tiny_dir)], str(tiny_dir), str(short), None, EvalStage(type="eval", seq_len=64), None)
