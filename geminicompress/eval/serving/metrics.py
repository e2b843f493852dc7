"""Per-request timings -> the serving figures: TTFT, TPOT, throughput, KV-cache hit rate. Pure bookkeeping,
shared by `eval --engine vllm` and `serve-bench` (both engines).

One request, all in seconds of one run's clock:
- TTFT = first token − arrival (queueing included: a request that waits for a busy engine waits);
- TPOT = (last token − first token) / (generated − 1);
- a run's throughput = requests / (last finish − first arrival), and generated tokens / the same;
- KV-cache hit rate = prompt tokens served from cache / prompt tokens (vLLM's `num_cached_tokens`; our
  own counts for the transformers engine).
vLLM's records (vllm_driver.py) are read as vLLM defines them: its TTFT is `first_token_latency` (from the
request's arrival to the iteration that produced the token), its TPOT comes from the engine-core
timestamps of the first and last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geminicompress.eval.cost.latency import summarize_ms


@dataclass
class RequestTiming:
    arrival: float  # seconds after the run started
    ttft: float  # seconds
    tpot: float | None  # seconds per token after the first; None for a single token
    finished: float  # seconds after the run started
    generated: int
    prompt_tokens: int
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)


def from_vllm(record: dict, start_wall: float) -> RequestTiming:
    """A request record of vllm_driver.serve_task as a RequestTiming."""
    n = int(record["num_generation_tokens"] or len(record["output"]))
    tpot = None
    if n > 1 and record.get("last_token_ts") is not None and record.get("first_token_ts") is not None:
        tpot = (record["last_token_ts"] - record["first_token_ts"]) / (n - 1)
    return RequestTiming(arrival=record["arrival_time"] - start_wall, ttft=float(record["first_token_latency"]),
                         tpot=tpot, finished=float(record["finished_s"]), generated=n,
                         prompt_tokens=int(record["prompt_tokens"]), cached_tokens=int(record["num_cached_tokens"]),
                         tokens=list(record["output"]))


def summarize(requests: list[RequestTiming]) -> dict:
    """The serving figures of one run (see the module docstring)."""
    if not requests:
        raise ValueError("no requests to summarize")
    span = max(r.finished for r in requests) - min(r.arrival for r in requests)
    prompt = sum(r.prompt_tokens for r in requests)
    return {
        "requests": len(requests),
        "ttft_ms": summarize_ms([r.ttft for r in requests], 3),
        "tpot_ms": summarize_ms([r.tpot for r in requests if r.tpot is not None], 3),
        "throughput_req_s": round(len(requests) / span, 4) if span > 0 else None,
        "throughput_tok_s": round(sum(r.generated for r in requests) / span, 3) if span > 0 else None,
        "duration_s": round(span, 3),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in requests),
        "kv_hit_rate": round(sum(r.cached_tokens for r in requests) / prompt, 4) if prompt else None,
    }


def token_agreement(outputs: list[list[int]], reference: list[list[int]]) -> float | None:
    """Fraction of generated tokens equal to the reference run's at the same position (greedy decoding:
    1.0 for a configuration that computes the same thing; a changed model or prompt shows here)."""
    same = total = 0
    for out, ref in zip(outputs, reference):
        n = min(len(out), len(ref))
        same += sum(a == b for a, b in zip(out[:n], ref[:n]))
        total += n
    return round(same / total, 4) if total else None


def first_divergences(outputs: list[list[int]], reference: list[list[int]]) -> list[tuple[int, int]]:
    """(request, position) of the first generated token that differs from the reference run's, per request
    that differs (after it the two answers continue from different text, so one tie can change the rest)."""
    out = []
    for i, (a, b) in enumerate(zip(outputs, reference)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is not None:
            out.append((i, pos))
    return out
