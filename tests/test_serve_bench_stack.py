"""serve-bench's stacking rule, load and table on fake timings (pure: no model): a row that loses is marked and
left out of the stack, the next row is added to the best row above it, the timed rows run at a share of the
stack's capacity, and the table shows each row's TTFT alone beside p50/p90 under load."""

from __future__ import annotations

import pytest

from geminicompress.core.errors import InputError
from geminicompress.eval.serving import table as serve_table
from geminicompress.eval.serving.bench import check_load
from geminicompress.eval.serving.metrics import RequestTiming
from geminicompress.eval.serving.passes import measure
from geminicompress.eval.serving.rows import ROWS, hf_rows
from geminicompress.eval.serving.servers import Served
from geminicompress.eval.serving.stack import SAME_ANSWERS, Load, load_rate, overloaded, verdict
from geminicompress.eval.serving.workload import Request, check_spec, WorkloadSpec

GIVEN = {"int8": "i8", "int4": "i4", "student": "s", "draft": "d"}


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Fake timings on a fake quiet machine: no other process's CPU seconds between readings."""
    from geminicompress.eval.cost import contention

    monkeypatch.setattr(contention, "read", lambda: contention.Reading(0.0, 0.0, 0.0, 0.0))


def test_verdict_joins_only_faster_rows_with_equal_answers():
    assert verdict(1.0, None, None).mark == "stack" and verdict(1.0, None, None).joins
    slower = verdict(0.49, 1.0, 1.0)
    assert (slower.joins, slower.mark, slower.speedup) == (False, "lost", 0.49)
    assert verdict(1.0, 1.0, 1.0).mark == "lost"  # a tie is not a win
    other = verdict(2.0, 1.0, SAME_ANSWERS - 0.01)
    assert (other.joins, other.mark, other.speedup) == (False, "trade", 2.0)
    assert verdict(2.0, 1.0, SAME_ANSWERS).joins and verdict(2.0, 1.0, SAME_ANSWERS).mark == "stacked"


def test_load_rate_and_its_refusals():
    assert load_rate(2.0, 0.7, None) == (pytest.approx(1.4), "0.7 x the stack's capacity 2 req/s = 1.4 req/s")
    assert load_rate(2.0, None, 0.5)[0] == 0.5
    assert overloaded(0.2, 1.4) and not overloaded(2.0, 1.4)
    assert check_load(None, None) == Load(0.7) and check_load(None, 0.5).share == 0.5
    assert check_load(3.0, None) == Load(None, 3.0) and check_load(None, None, 4) == Load(None, None, 4)
    with pytest.raises(InputError, match="--rate and --load both set"):
        check_load(3.0, 0.5)
    with pytest.raises(InputError, match="--load and --concurrency both set"):
        check_load(None, 0.5, 2)
    with pytest.raises(InputError, match="at least 1 client"):
        check_load(None, None, 0)
    with pytest.raises(InputError, match="between 0 and 1"):
        check_load(None, 1.2)
    with pytest.raises(InputError, match="--rate must be > 0 .* capacity pass"):
        check_spec(WorkloadSpec(rate=0.0), None)


class FakeServer:
    """Each row's fake speed: `per_s[name]` requests/s whatever the arrivals (a burst finishes at n / rate);
    answers from `answers[name]` (default the same for every row); records the flags each row was served with."""

    def __init__(self, per_s: dict[str, float], answers: dict[str, list[int]] | None = None):
        self.per_s, self.answers, self.flags, self.calls = per_s, answers or {}, {}, []

    def serve(self, row, flags, requests, concurrency=None, with_ppl=False):
        alone = concurrency == 1
        self.flags.setdefault(row.name, flags)
        self.calls.append((row.name, len(requests), alone))
        gap = 1.0 / self.per_s[row.name]
        tokens = self.answers.get(row.name, [1, 2, 3, 4])
        timings = [RequestTiming(r.arrival_s, gap if alone else gap * (i + 1) - r.arrival_s, 0.01 * gap, gap * (i + 1),
                                 4, 8, 0, list(tokens)) for i, r in enumerate(requests)]
        extra = {"acceptance": {"proposed": 40, "accepted": 30, "rounds": 10}} if flags.get("draft") else {}
        return Served(timings, 10.0 if with_ppl else None, extra)

    def close(self):
        pass


def _requests(n: int) -> list[Request]:
    return [Request(i, 0.0, [0] * 4, [i] * 4, 4) for i in range(n)]


def _measured():
    speeds = {"original configuration": 1.0, "prompt truncation": 1.3, "FlashAttention": 1.2, "KV-cache reuse": 1.5,
              "dynamic batching": 4.0, "PagedAttention": 2.0, "INT8 (W8A8)": 5.0, "INT4 (GPTQ)": 3.0,
              "distilled student": 6.0, "speculative decoding": 1.6}
    server = FakeServer(speeds, {"prompt truncation": [9, 9, 3, 4], "INT8 (W8A8)": [1, 2, 3, 9],
                                 "distilled student": [1, 2, 9, 9]})
    entries, load = measure(hf_rows(8, GIVEN), _requests(16), 8, Load(0.7), 0, server, _NoProgress())
    return server, {e["row"]: e for e in entries}, load


class _NoProgress:
    from contextlib import contextmanager

    @contextmanager
    def task(self, *a, **k):
        class Bar:
            def advance(self, *a, **k):
                pass

        yield Bar()

    def info(self, *a, **k):
        pass

    def warn(self, *a, **k):
        pass


def test_rows_stack_on_the_best_so_far_never_on_a_row_that_lost():
    server, rows, load = _measured()
    marks = [rows[n]["mark"] for n in ROWS]
    assert marks == ["stack", "trade", "stacked", "stacked", "stacked", "lost", "trade", "lost", "trade", "lost"]
    # truncation changed the answers: FlashAttention is added to the first row, not to it
    assert server.flags["FlashAttention"] == {"attn": "sdpa"} and rows["FlashAttention"]["added_to"] == ROWS[0]
    # PagedAttention lost (0.5x): INT8 is added to the batching row, without the paged flag
    assert rows["PagedAttention"]["speedup"] == 0.5 and rows["INT8 (W8A8)"]["added_to"] == "dynamic batching"
    assert "paged" not in server.flags["INT8 (W8A8)"] and server.flags["INT8 (W8A8)"]["max_batch"] == 8
    assert rows["INT4 (GPTQ)"]["speedup"] == 0.75 and rows["distilled student"]["speedup"] == 1.5
    assert server.flags["speculative decoding"]["draft"] and server.flags["speculative decoding"]["max_batch"] == 1
    assert load["stack"] == "dynamic batching" and load["stack_capacity_req_s"] == 4.0
    assert load["rate_req_s"] == pytest.approx(2.8) and load["capacity_requests"] == 8
    # every measured row: a burst of 8, the 16 requests at the load, 3 alone
    assert [c for c in server.calls if c[0] == "KV-cache reuse"] == [("KV-cache reuse", 8, False),
                                                                     ("KV-cache reuse", 16, False),
                                                                     ("KV-cache reuse", 3, True)]
    assert rows["original configuration"]["overloaded"] and not rows["dynamic batching"]["overloaded"]
    assert rows["INT8 (W8A8)"]["answer_agreement"] == 0.75 and rows["INT8 (W8A8)"]["ppl_drift"] == 0.0
    assert rows["speculative decoding"]["verifier_agreement"] == 1.0


def test_table_marks_rows_and_shows_ttft_alone_beside_load():
    _, rows, load = _measured()
    report = {"engine": "transformers", "model": "m", "data": "d", "max_batch": 8, "load": load, "notes": [],
              "workload": {"requests": 16, "prefix_len": 4, "question_len": 4, "truncated_len": 6, "answer_len": 4},
              "rows": [rows[n] for n in ROWS]}
    cells = {c[0]: c for c in serve_table.cells(report)}
    assert cells["PagedAttention"][1] == "x lost *" and cells["PagedAttention"][2] == "2\n(0.50x)"
    assert cells["dynamic batching"][1] == "+ stacked" and cells["original configuration"][1] == "start *"
    assert cells["dynamic batching"][3] == "250"  # TTFT alone: one request, 0.25 s
    assert cells["INT8 (W8A8)"][7] == "75.0%"
    notes = serve_table.comparisons(report)
    assert any("stack: dynamic batching" in n for n in notes)
    spec = next(n for n in notes if n.startswith("speculative decoding"))
    assert "acceptance 75.0%" in spec and "3.00 accepted per verification step" in spec and "100.0% equal" in spec
    assert "TPOT alone 2.50x the verifier's alone" in spec
    student = next(n for n in notes if n.startswith("distilled student"))
    assert "1.50x the burst req/s of dynamic batching" in student and "TPOT alone 0.67x" in student
    assert "TTFT alone 0.67x its" in student and "lost" not in student
    int4 = next(n for n in notes if n.startswith("INT4 (GPTQ)"))  # 0.75x: lost, slower in both phases
    assert "TTFT alone 1.33x its, TPOT alone 1.33x its" in int4 and int4.endswith("lost on both the prompts and the answers")
    md = serve_table.markdown(report)
    assert "| PagedAttention | x lost * | 2 (0.50x) | 500 |" in md and "timed at 0.7 x the stack's capacity 4 req/s" in md


def test_divergences_and_float_ties_in_the_table():
    from geminicompress.eval.serving.metrics import first_divergences
    from geminicompress.eval.serving.table import _ties

    assert first_divergences([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [0, 8]]) == [(1, 1), (2, 0)]
    assert _ties({"requests": 2, "logit_gaps": [3e-6, 1.2], "ties": 1}) == \
        ", 2 answers leave it, 1 at a float tie (logit gaps 3e-06, 1.2)"
    assert _ties({"requests": 0}) == ""


def test_closed_loop_load():
    server = FakeServer({n: 1.0 for n in ROWS})
    entries, load = measure(hf_rows(8, {}), _requests(6), 4, Load(None, None, 2), 0, server, _NoProgress())
    assert load["concurrency"] == 2 and load["rate_req_s"] is None and "2 clients in a closed loop" in load["how"]
    assert all(e["overloaded"] is None for e in entries if e["metrics"])


def test_table_at_80_columns_cuts_nothing():
    from rich.console import Console

    _, rows, load = _measured()
    rows["INT4 (GPTQ)"] = {**rows["INT4 (GPTQ)"], "metrics": None, "reason": "no GPTQ model given (--int4 OUT)"}
    report = {"engine": "transformers", "model": "m", "data": "d", "max_batch": 8, "load": load, "notes": [],
              "workload": {"requests": 16, "prefix_len": 4, "question_len": 4, "truncated_len": 6, "answer_len": 4},
              "rows": [rows[n] for n in ROWS]}
    console = Console(width=80, record=True)
    console.print(serve_table.rich_table(report, 80))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80 and "…" not in text
    assert "(not measured: no GPTQ model given (--int4 OUT))" in text.replace("\n", " ").replace("  ", " ")


def test_a_row_timed_on_a_busy_machine_is_marked(monkeypatch):
    from geminicompress.eval.cost import contention

    readings = iter([contention.Reading(0.0, 0.0, 0.0, 1.0), contention.Reading(10.0, 30.0, 20.0, 3.0)] * 100)
    monkeypatch.setattr(contention, "read", lambda: next(readings))  # 1 core of others during every section
    server = FakeServer({n: 1.0 for n in ROWS})
    entries, load = measure(hf_rows(8, {}), _requests(4), 4, Load(0.5), 0, server, _NoProgress())
    first = entries[0]
    assert first["busy"] and first["contention"]["capacity"]["other_cores"] == 1.0
    report = {"engine": "t", "model": "m", "data": "d", "max_batch": 8, "load": load, "notes": [],
              "workload": {"requests": 4, "prefix_len": 4, "question_len": 4, "truncated_len": 6, "answer_len": 4},
              "rows": entries}
    assert serve_table.cells(report)[0][1] == "start !"
    assert any(n.startswith("! timed while other processes") and "original configuration capacity 1.0 cores" in n
               for n in serve_table.comparisons(report))


def test_a_lost_row_says_which_phase_lost_it():
    from geminicompress.eval.serving.table import _why_lost

    lost = {"mark": "lost"}
    # the W8A8 row of the quiet demo table: faster per answer token (0.56x), slower on the prompt (1.50x)
    assert _why_lost(lost, 1.50, 0.56) == "; lost on the prompts: faster per answer token, slower to read a prompt"
    assert _why_lost(lost, 0.9, 1.2) == "; lost on the answers: faster to read a prompt, slower per answer token"
    assert _why_lost(lost, 0.9, 0.9) == "; lost in the burst's batches, though faster alone in both phases"
    assert _why_lost({"mark": "trade"}, 1.5, 0.5) == "" and _why_lost(lost, None, 0.5) == ""
