import sys
import time
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class Stats:
    arrival_time: float = 0.0
    first_token_latency: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class Completion:
    token_ids: list


@dataclass
class Output:
    request_id: str
    prompt_token_ids: list
    prompt_logprobs: list | None
    outputs: list
    finished: bool
    metrics: Stats
    num_cached_tokens: int = 0


class LLMEngine:
    def __init__(self, args):
        assert "refuse" not in args.model
        self.args, self.pending, self.seen = args, [], set()
        print("INFO Using FakeWNA16Kernel for FakeGPTQLinearMethod", file=sys.stderr)
        print("INFO Using FAKE_ATTN backend.", file=sys.stderr)

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.pending.append((request_id, prompt["prompt_token_ids"], params, arrival_time or time.time()))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def reset_prefix_cache(self):
        self.seen = set()

    def step(self):
        outs, now = [], time.monotonic()
        for rid, ids, params, arrival in self.pending:
            lps = None
            if params.prompt_logprobs is not None:  # logp of token i = -(i % 3 + 1); the rank-1 token is 7
                lps = [None] + [{7: Logprob(-0.5, 1), tok: Logprob(-(i % 3 + 1.0), 1 if tok == 7 else 2)}
                                for i, tok in enumerate(ids[1:], start=1)]
            cached = 16 * (len(ids) // 16) if tuple(ids[:16]) in self.seen else 0  # one "block" of 16
            self.seen.add(tuple(ids[:16]))
            n = params.max_tokens
            stats = Stats(arrival, 0.25, now, now, now, now + 0.01 * (n - 1), n)
            outs.append(Output(rid, ids, lps, [Completion([(ids[-1] + k) % 50 for k in range(n)])], True, stats, cached))
        self.pending = []
        return outs
