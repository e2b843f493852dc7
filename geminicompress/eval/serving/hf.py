"""A small serving loop over a transformers model, for the `serve-bench` rows run in this process.

Requests arrive on the wall clock (workload.py); the loop serves them with one row's engine flags:

- `attn`: "eager" (attention as plain matmuls) or "sdpa" (torch's scaled_dot_product_attention: its
  flash-attention kernel, on the CPU too);
- `truncate`: prompts cut to the workload's truncated length;
- `prefix_cache`: the shared prefix's KV cache is computed once (by the first request that needs it) and
  copied into every later request, which then prefills only its own tokens: a prompt cache reused across
  requests; its hits are counted;
- `max_batch`: > 1 is dynamic batching: whatever has arrived when the loop is free (up to `max_batch`
  requests) is prefilled and decoded together (every prompt has the same length, so no padding);
  later arrivals wait for the batch to finish;
- `paged`: transformers' continuous-batching manager with its paged KV cache (`init_continuous_batching`,
  the engine behind `generate_batch`): requests join and leave the running batch at every step, the
  cache is paged, and with `prefix_cache` its blocks are shared between requests (hits counted by
  wrapping its prefix search).

With `concurrency` N (a closed loop), the first N requests arrive at once and each later one when a request
before it has finished, whatever its own arrival time: N clients, each sending its next request when its
answer is done. N = 1 is one request alone on the server (TTFT without queueing; the prefix cache, when
on, warm after the first).

Every request generates exactly `answer_len` greedy tokens (EOS ignored). Timings are wall-clock
`perf_counter` in this process (serving_metrics.RequestTiming).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from geminicompress.eval.cost.latency import cache_of, forward_args
from geminicompress.eval.serving.metrics import RequestTiming
from geminicompress.eval.serving.workload import Request
from geminicompress.kernels.decode_attention import attention_name

NO_EOS = -1  # a token id no model produces: answers are never cut short


@dataclass(frozen=True)
class HFFlags:
    attn: str = "eager"
    truncate: bool = False
    prefix_cache: bool = False
    max_batch: int = 1
    paged: bool = False


def serve(model, requests: list[Request], flags: HFFlags, truncated_len: int, prefix_len: int,
          warmup: bool = True, concurrency: int | None = None) -> list[RequestTiming]:
    """Serve `requests` with `flags` (as a closed loop of `concurrency` clients when given); one RequestTiming
    per request, in request order."""
    model.set_attn_implementation(attention_name(model, flags.attn))
    max_len = truncated_len if flags.truncate else None
    if flags.paged:
        return _serve_paged(model, requests, flags, max_len, prefix_len, warmup, concurrency)
    if warmup:  # one request of the same shape that shares nothing with the workload
        _serve_loop(model, [_stranger(requests[0])], flags, max_len, prefix_len, shared=False)
    return _serve_loop(model, requests, flags, max_len, prefix_len, shared=True, concurrency=concurrency)


def _stranger(r: Request) -> Request:
    """A warm-up request as long as `r` whose tokens share no prefix with the workload."""
    tokens = list(reversed(r.prefix + r.question))
    return Request(-1, 0.0, tokens[:len(r.prefix)], tokens[len(r.prefix):], r.answer_len)


@torch.no_grad()
def closed_loop(requests: list[Request], concurrency: int | None) -> tuple[list[Request], list[Request]]:
    """(requests arriving at the start, requests released one per finished request) of a closed loop; all
    requests in arrival order at their own times without `concurrency`."""
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    if not concurrency:
        return ordered, []
    return [replace(r, arrival_s=0.0) for r in ordered[:concurrency]], ordered[concurrency:]


@torch.no_grad()
def _serve_loop(model, requests, flags, max_len, prefix_len, shared: bool,
                concurrency: int | None = None) -> list[RequestTiming]:
    device = next(model.parameters()).device
    cache_arg, extra = forward_args(model)
    prefix_kv = None  # the shared prefix's cache, once a request has computed it
    pending, waiting = closed_loop(requests, concurrency)
    done: dict[int, RequestTiming] = {}
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        ready = [r for r in pending if r.arrival_s <= now]
        if not ready:
            time.sleep(pending[0].arrival_s - now)
            continue
        batch = ready[:flags.max_batch]
        for r in batch:
            pending.remove(r)
        prompts = torch.tensor([r.prompt(max_len) for r in batch], device=device)  # (B, L)
        hits = [0] * len(batch)
        kwargs = dict(extra)
        if flags.prefix_cache and prefix_len > 0:
            if prefix_kv is None:  # the first request pays for the prefix; the rest of its batch reuses it
                out = model(input_ids=prompts[:1, :prefix_len], use_cache=True, **extra)  # last logits only
                prefix_kv = cache_of(out)
                hits = [0] + [prefix_len] * (len(batch) - 1)
            else:
                hits = [prefix_len] * len(batch)
            cache = copy.deepcopy(prefix_kv)
            if len(batch) > 1:
                cache.batch_repeat_interleave(len(batch))
            kwargs[cache_arg] = cache
            prompts = prompts[:, prefix_len:]
        out = model(input_ids=prompts, use_cache=True, **kwargs)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        first = time.perf_counter() - start
        tokens = [token]
        for _ in range(batch[0].answer_len - 1):
            out = model(input_ids=token, use_cache=True, **{cache_arg: cache_of(out)})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        end = time.perf_counter() - start
        generated = torch.cat(tokens, dim=1).tolist()  # (B, answer_len)
        n = batch[0].answer_len
        for r, hit, gen, length in zip(batch, hits, generated, [len(r.prompt(max_len)) for r in batch]):
            done[r.index] = RequestTiming(r.arrival_s, first - r.arrival_s, (end - first) / (n - 1), end, n, length,
                                          hit if shared else 0, gen)
            if waiting:  # its client sends the next request
                pending.append(replace(waiting.pop(0), arrival_s=end))
    return [done[r.index] for r in sorted(requests, key=lambda r: r.index)]


@contextmanager
def counting_prefix_hits() -> Iterator[dict[str, int]]:
    """Prompt tokens the continuous-batching cache found already cached, per request id (its prefix search,
    wrapped for the duration)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    original = PagedAttentionCache.search_prefix_match
    hits: dict[str, int] = {}

    def counting(self, request_id: str, prompt_ids: list[int]) -> int:
        n = original(self, request_id, prompt_ids)
        hits[request_id] = hits.get(request_id, 0) + n
        return n

    PagedAttentionCache.search_prefix_match = counting
    try:
        yield hits
    finally:
        PagedAttentionCache.search_prefix_match = original


def _paged_config(flags: HFFlags, requests: list[Request], max_len: int | None):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    longest = len(requests[0].prompt(max_len)) + requests[0].answer_len
    pages = -(-longest // page)
    return ContinuousBatchingConfig(page_size=page, num_blocks=(flags.max_batch + 2) * pages + 8,
                                    max_batch_tokens=max(512, longest), max_requests_per_batch=flags.max_batch,
                                    allow_block_sharing=flags.prefix_cache, use_cuda_graph=False)


def _submit(manager, requests, max_len, n, start, concurrency) -> dict:
    """Requests into the continuous-batching manager at their arrival times (or as a closed loop: the next
    one once the oldest in flight has finished); {index: (request as submitted, result)}."""
    pending, waiting = closed_loop(requests, concurrency)

    def add(r: Request) -> tuple[Request, str]:
        wait = r.arrival_s - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        return r, manager.add_request(r.prompt(max_len), request_id=f"r{r.index}", max_new_tokens=n,
                                      record_timestamps=True, eos_token_id=NO_EOS)

    flight = [add(r) for r in pending]
    outs = {}
    while flight:
        r, rid = flight.pop(0)
        outs[r.index] = (r, manager.get_result(request_id=rid, timeout=600))
        if waiting:
            flight.append(add(replace(waiting.pop(0), arrival_s=time.perf_counter() - start)))
    return outs


def _serve_paged(model, requests, flags, max_len, prefix_len, warmup, concurrency=None) -> list[RequestTiming]:
    from transformers import GenerationConfig

    n = requests[0].answer_len
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=NO_EOS, pad_token_id=0)
    with counting_prefix_hits() as hits:
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=_paged_config(flags, requests, max_len))
        manager.start()
        try:
            if warmup:
                rid = manager.add_request(_stranger(requests[0]).prompt(max_len), request_id="warmup",
                                          max_new_tokens=n, eos_token_id=NO_EOS)
                manager.get_result(request_id=rid, timeout=600)
            start = time.perf_counter()
            outs = _submit(manager, requests, max_len, n, start, concurrency)
        finally:
            manager.stop(block=True)
            if hasattr(model, "destroy_cached_continuous_batching_manager"):
                model.destroy_cached_continuous_batching_manager()
    done = []
    for i in sorted(outs):
        r, out = outs[i]
        if out is None or out.error:
            raise RuntimeError(f"continuous batching failed on request {i}: {getattr(out, 'error', 'no result')}")
        stamps = [t - start for t in out.timestamps]
        done.append(RequestTiming(r.arrival_s, stamps[0] - r.arrival_s, (stamps[-1] - stamps[0]) / (n - 1), stamps[-1],
                                  len(out.generated_tokens), len(r.prompt(max_len)), hits.get(f"r{i}", 0),
                                  list(out.generated_tokens)))
    return done
