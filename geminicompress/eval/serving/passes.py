"""serve-bench's two passes over the rows, every row in the same run (stack.py states the rule):

1. capacity: each row served a burst (the first `capacity_requests` requests, all arriving at once), on the
   stack measured above it; its requests/s decide whether it joins the stack. The rows that change the model
   (and the first row) also score the perplexity windows.
2. load: each measured row again, at one arrival rate for all (a share of the final stack's capacity, or
   --rate), the full workload: TTFT p50/p90 and TPOT under that load; then `ALONE` requests, each alone on
   the server (TTFT and TPOT without queueing).

Answers are compared, per row, with the first row's (the quality column) and, in the capacity pass, with the
stack's (the rule); the speculative row also with its verifier's (the stack's model on the same requests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from geminicompress.eval.cost import contention
from geminicompress.eval.serving.metrics import first_divergences, summarize, token_agreement
from geminicompress.eval.serving.rows import Row
from geminicompress.eval.serving.servers import RowRefused
from geminicompress.eval.serving.stack import Load, closed_loop_note, load_rate, overloaded, stacked, verdict
from geminicompress.eval.serving.workload import Request, arrivals
from geminicompress.host.progress import Progress

ALONE = 3  # requests served alone, one after another, per row (the first warms a prefix cache)
TIE_LOGIT = 1e-3  # a logit gap below this between two answers' tokens is a float tie (float32 rounding: ~1e-5)


@dataclass
class _Stack:
    row: str
    flags: dict
    capacity: float | None
    answers: list


def _served(server, entry: dict, section: str, *args, **kwargs):
    """server.serve(*args, **kwargs), with how many cores other processes kept busy meanwhile recorded in the
    entry (eval/cost/contention.py): a row timed on a busy machine is marked, not silently kept."""
    before = contention.read()
    served = server.serve(*args, **kwargs)
    busy = contention.between(before, contention.read())
    entry.setdefault("contention", {})[section] = busy
    if busy["other_cores"] >= contention.BUSY_MIN_CORES:
        entry["busy"] = True
    return served


def _entry(row: Row) -> dict:
    return {"row": row.name, "change": row.change, "flags": None, "model": row.model, "reason": row.reason,
            "mark": None, "added_to": None, "capacity_req_s": None, "speedup": None, "stack_agreement": None,
            "metrics": None, "alone": None, "overloaded": None, "answer_agreement": None, "perplexity": None,
            "ppl_drift": None, "busy": False}


def _ppl(entry: dict, ppl: float | None, base_ppl: float | None) -> float | None:
    """Record a row's perplexity and its drift from the first row's; the first row's perplexity."""
    if ppl is None:
        return base_ppl
    base_ppl = base_ppl or ppl
    entry["perplexity"] = round(ppl, 6)
    entry["ppl_drift"] = round(ppl / base_ppl - 1.0, 6)
    return base_ppl


def capacity_pass(rows: list[Row], entries: list[dict], burst: list[Request], server, progress: Progress) -> _Stack:
    """Pass 1 (module docstring): every row on the stack above it, the stack updated by the rule."""
    stack, base_ppl = None, None
    with progress.task("capacity pass (a burst per row)", len(rows)) as bar:
        for row, e in zip(rows, entries):
            bar.advance(1, row=row.name)
            if row.reason is not None:
                continue
            e["flags"] = stacked(stack.flags if stack else {}, row.flags)
            try:
                served = _served(server, e, "capacity", row, e["flags"], burst,
                                 with_ppl=base_ppl is None or row.model != "base")
            except RowRefused as exc:
                e["reason"] = str(exc)
                progress.warn(f"row {row.name}: {exc}")
                continue
            capacity = summarize(served.timings)["throughput_req_s"]
            answers = [t.tokens for t in served.timings]
            e["stack_agreement"] = None if stack is None else token_agreement(answers, stack.answers)
            v = verdict(capacity, stack.capacity if stack else None, e["stack_agreement"])
            e.update(capacity_req_s=capacity, mark=v.mark, speedup=None if v.speedup is None else round(v.speedup, 4),
                     added_to=stack.row if stack else None, **served.extra)
            base_ppl = _ppl(e, served.ppl, base_ppl)
            progress.info(f"row {row.name}: {capacity} req/s in a burst, {v.mark}")
            if v.joins:
                stack = _Stack(row.name, e["flags"], capacity, answers)
    if stack is None:
        raise RuntimeError("serve-bench: no row could be served")
    return stack


def load_pass(rows: list[Row], entries: list[dict], requests: list[Request], rate: float | None, server,
              progress: Progress, concurrency: int | None = None) -> None:
    """Pass 2 (module docstring): every measured row at `rate` (or as a closed loop of `concurrency`
    clients), then ALONE requests alone."""
    first, verifier = None, None
    with progress.task("load pass (every row at one rate)", len(rows)) as bar:
        for row, e in zip(rows, entries):
            bar.advance(1, row=row.name)
            if e["mark"] is None:
                continue
            try:
                served = _served(server, e, "load", row, e["flags"], requests, concurrency=concurrency)
                alone = _served(server, e, "alone", row, e["flags"], requests[:ALONE], concurrency=1)
            except RowRefused as exc:
                e["reason"] = f"load pass: {exc}"
                progress.warn(f"row {row.name}: {exc}")
                continue
            e["metrics"] = summarize(served.timings)
            e.update({k: v for k, v in served.extra.items() if k == "acceptance"})
            answers = [t.tokens for t in served.timings]
            first = first or answers
            e["answer_agreement"] = token_agreement(answers, first)
            if row.model == "base" and e["mark"] in ("stack", "stacked"):
                verifier = answers  # the best configuration of MODEL itself: what the draft's verifier answers
            if e["flags"].get("draft") and verifier is not None:
                e["verifier_agreement"] = token_agreement(answers, verifier)
                e["divergences"] = _divergences(server, e["flags"], requests, verifier, answers)
            e["overloaded"] = None if rate is None else overloaded(e["capacity_req_s"], rate)
            e["alone"] = summarize(alone.timings)


def _divergences(server, flags: dict, requests: list[Request], verifier: list, answers: list) -> dict:
    """Where the speculative answers left the verifier's, and MODEL's logit gap there (a float tie when
    below TIE_LOGIT)."""
    found = first_divergences(answers, verifier)
    gaps = (server.logit_gaps(flags, requests, verifier, answers, found) if found and hasattr(server, "logit_gaps")
        else None)
    ties = None if gaps is None else sum(abs(g) < TIE_LOGIT for g in gaps)
    return {"requests": len(found), "at": found, "logit_gaps": gaps, "ties": ties}


def measure(rows: list[Row], requests: list[Request], capacity_requests: int, load: Load, seed: int, server,
            progress: Progress) -> tuple[list[dict], dict]:
    """Both passes; (one entry per row, the load: rate or clients, how it was chosen, the stack and its
    capacity)."""
    entries = [_entry(r) for r in rows]
    burst = [replace(r, arrival_s=0.0) for r in requests[:capacity_requests]]
    try:
        stack = capacity_pass(rows, entries, burst, server, progress)
        if load.concurrency:
            req_s, how, timed = None, closed_loop_note(load.concurrency), requests
        else:
            req_s, how = load_rate(stack.capacity, load.share, load.rate)
            timed = [replace(r, arrival_s=t) for r, t in zip(requests, arrivals(len(requests), req_s, seed))]
        load_pass(rows, entries, timed, req_s, server, progress, load.concurrency)
    finally:
        server.close()
    summary = {"rate_req_s": None if req_s is None else round(req_s, 4), "how": how,
               "share": None if load.rate is not None or load.concurrency else load.share,
               "concurrency": load.concurrency, "stack": stack.row, "stack_capacity_req_s": stack.capacity,
               "capacity_requests": len(burst), "alone_requests": ALONE}
    return entries, summary
