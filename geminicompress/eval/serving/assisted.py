"""The speculative decoding row of `serve-bench`: a draft model proposes tokens, the served model verifies
them (Leviathan et al., 2023), in our own greedy loop (draft_loop.py: `DRAFT_TOKENS` proposals a round, one
verification forward, both KV caches cropped back). Greedy and exact: the answers are the verifier's own, up to
float ties between a verification forward and a one-token step (the table counts and shows them).

The loop takes one sequence at a time, so requests are served one after another in arrival order (a request
that arrives while another is served waits: TTFT includes that queue); with `concurrency` N, request i arrives
when request i − N has finished (a closed loop of N clients, hf.py). Per request: TTFT = the first token (the
model's prefill) − the request's arrival; TPOT = (last − first) / (tokens after the first). EOS is never
produced (the answer is always `answer_len` tokens). Acceptance is counted by the loop itself.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from geminicompress.eval.serving.metrics import RequestTiming
from geminicompress.eval.serving.rows import DRAFT_TOKENS
from geminicompress.eval.serving.workload import Request
from geminicompress.eval.serving.draft_loop import DraftCounts, speculative_greedy


@torch.no_grad()
def serve_assisted(model, draft, requests: list[Request], max_len: int | None, warmup: bool = True,
                   concurrency: int | None = None, draft_tokens: int = DRAFT_TOKENS) -> tuple[list[RequestTiming], dict]:
    """Serve `requests` one at a time with `draft` proposing `draft_tokens` a round; (timings in request order,
    acceptance: proposed, accepted, rounds)."""
    n = requests[0].answer_len
    if warmup:
        speculative_greedy(model, draft, list(reversed(requests[0].prompt(max_len))), n, draft_tokens)
    done: dict[int, RequestTiming] = {}
    counts = DraftCounts()
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    for i, r in enumerate(ordered):
        if concurrency:  # its client sent it when its request `concurrency` before finished
            r = replace(r, arrival_s=0.0 if i < concurrency else done[ordered[i - concurrency].index].finished)
        if r.arrival_s > clock():
            time.sleep(r.arrival_s - clock())
        first: list[float] = []
        tokens, c = speculative_greedy(model, draft, r.prompt(max_len), n, draft_tokens, lambda: first.append(clock()))
        end = clock()
        counts.add(c)
        later = len(tokens) - 1
        done[r.index] = RequestTiming(r.arrival_s, first[0] - r.arrival_s, (end - first[0]) / later if later > 0 else None,
                                      end, len(tokens), len(r.prompt(max_len)), 0, tokens)
    return ([done[r.index] for r in sorted(requests, key=lambda r: r.index)],
            {"proposed": counts.proposed, "accepted": counts.accepted, "rounds": counts.rounds,
             "draft_tokens": draft_tokens})
