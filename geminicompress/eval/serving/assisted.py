"""The speculative decoding row of `serve-bench`: a draft model proposes tokens, the served model verifies
them (Leviathan et al., 2023), through transformers' assisted generation (`assistant_model=`), as
`eval --draft` measures it (eval/speculative.py). Greedy and exact: the answers are the verifier's own.

Assisted generation takes one sequence at a time, so requests are served one after another in arrival
order (a request that arrives while another is served waits: TTFT includes that queue); with `concurrency`
N, request i arrives when request i − N has finished (a closed loop of N clients, hf.py). Per request:
TTFT = the first generated token's arrival at the streamer − the request's arrival; TPOT = (last − first) /
(tokens after the first round): the first verification round can deliver several tokens at once, and they
are counted with the first token, not as decode (hf.py's loop delivers one, so the two agree there; the
looser (last − first) / (answer_len − 1) would credit those tokens to decode at no cost). EOS is never
produced (the answer is always `answer_len` tokens).
Acceptance is counted from what transformers reports after each verification (speculative.count_acceptance).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from geminicompress.eval.serving.metrics import RequestTiming
from geminicompress.eval.serving.workload import Request
from geminicompress.eval.speculative import count_acceptance


class _FirstToken:
    """A generate() streamer that notes when the first new tokens arrive and how many (its first `put` is
    the prompt)."""

    def __init__(self, clock):
        self.clock, self.puts, self.first, self.with_first = clock, 0, None, 1

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first, self.with_first = self.clock(), max(1, int(value.numel()))

    def end(self) -> None:
        pass


def _no_eos(model) -> None:
    """Greedy answers of exactly the budget, EOS never chosen as a stop (hf.py's NO_EOS)."""
    model.generation_config.eos_token_id = None


@torch.no_grad()
def serve_assisted(model, draft, requests: list[Request], max_len: int | None, warmup: bool = True,
                   concurrency: int | None = None) -> tuple[list[RequestTiming], dict]:
    """Serve `requests` one at a time with `draft` as the assistant; (timings in request order, acceptance:
    proposed, accepted, rounds)."""
    device = next(model.parameters()).device
    for m in (model, draft):
        _no_eos(m)
    n = requests[0].answer_len
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, assistant_model=draft,
                  pad_token_id=0, eos_token_id=None)

    def generate(prompt: list[int], streamer=None) -> list[int]:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    if warmup:
        generate(list(reversed(requests[0].prompt(max_len))))
    done: dict[int, RequestTiming] = {}
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    with count_acceptance() as counts:
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        for i, r in enumerate(ordered):
            if concurrency:  # its client sent it when its request `concurrency` before finished
                r = replace(r, arrival_s=0.0 if i < concurrency else done[ordered[i - concurrency].index].finished)
            if r.arrival_s > clock():
                time.sleep(r.arrival_s - clock())
            streamer = _FirstToken(clock)
            tokens = generate(r.prompt(max_len), streamer)
            end = clock()
            first = streamer.first if streamer.first is not None else end
            later = len(tokens) - streamer.with_first
            done[r.index] = RequestTiming(r.arrival_s, first - r.arrival_s, (end - first) / later if later > 0 else None,
                                          end, len(tokens), len(r.prompt(max_len)), 0, tokens)
    return [done[r.index] for r in sorted(requests, key=lambda r: r.index)], dict(counts)
