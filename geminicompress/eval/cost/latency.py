"""Latency and throughput of greedy decoding with the KV cache, measured like a benchmark.

One timed run = prefill a (B, P) prompt, then decode `gen_len - 1` more tokens one step at a time,
always the argmax, never stopping at EOS, so that every model does exactly the same work.

- TTFT (time to first token): prefill + first argmax at batch 1.
- TPOT (time per output token): decode time / (gen_len - 1) at batch 1 (prefill excluded).
- throughput: B * gen_len generated tokens / the whole run's time, for each batch size B.

Each batch size gets `warmup` untimed runs, then `repeats` timed runs; we report the median and the
90th percentile. On a GPU every timestamp is taken after `torch.cuda.synchronize()`. Around each batch
size's timed runs we record how busy the other processes kept the cores (`contention.py`); the
verdict (`load`) says whether the figures can be trusted.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from geminicompress.eval.cost import contention as contention
from geminicompress.host.memory import heap_reuse
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.host.threads import usable_cores


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA) before a timestamp; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of the samples."""
    return float(torch.quantile(torch.tensor(samples, dtype=torch.float64), q / 100.0))


def summarize_ms(seconds: list[float], digits: int = 4) -> dict[str, float] | None:
    """Median and p90 in ms, rounded to `digits` decimals; None when there are no samples."""
    if not seconds:
        return None
    ms = [s * 1000.0 for s in seconds]
    return {"median": round(percentile(ms, 50), digits), "p90": round(percentile(ms, 90), digits)}


def forward_args(model) -> tuple[str, dict]:
    """(name of the KV-cache argument, extra prefill kwargs) that this model's forward accepts:
    transformers >= 5 calls the cache `cache`, earlier versions `past_key_values`; `logits_to_keep=1`
    (only the last position's logits at prefill, as `generate` does) where supported."""
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return cache_arg, ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


def cache_of(out):
    """The KV cache a forward returned (`cache` in transformers >= 5, else `past_key_values`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@dataclass
class RunTiming:
    prefill_s: float  # prompt in, first token out
    decode_s: float  # the remaining gen_len - 1 tokens
    generated: torch.Tensor  # (B, gen_len) token ids


@torch.no_grad()
def greedy_run(model, prompt: torch.Tensor, gen_len: int, device: torch.device) -> RunTiming:
    """One greedy generation of exactly `gen_len` tokens after `prompt` (B, P), with the KV cache."""
    ids = prompt.to(device)
    cache_arg, prefill_kwargs = forward_args(model)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, **prefill_kwargs)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    sync(device)
    t1 = time.perf_counter()
    tokens = [token]
    for _ in range(gen_len - 1):
        out = model(input_ids=token, use_cache=True, **{cache_arg: cache_of(out)})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    sync(device)
    t2 = time.perf_counter()
    return RunTiming(t1 - t0, t2 - t1, torch.cat(tokens, dim=1).cpu())


def median_tpot(model, prompt: torch.Tensor, gen_len: int, device: torch.device, *, repeats: int = 3,
                warmup: int = 0) -> float:
    """Seconds per output token (prefill excluded, as `measure_latency`'s TPOT): the median over `repeats` timed
    `greedy_run`s of `gen_len` tokens after `prompt`, after `warmup` untimed ones."""
    for _ in range(warmup):
        greedy_run(model, prompt, gen_len, device)
    return statistics.median(greedy_run(model, prompt, gen_len, device).decode_s / (gen_len - 1) for _ in range(repeats))


def prompt_batch(ids: torch.Tensor, batch: int, prompt_len: int) -> torch.Tensor:
    """`batch` distinct prompts of `prompt_len` tokens cut from `ids` (N,), repeating the text if short."""
    need = batch * prompt_len
    if ids.numel() < need:
        ids = ids.repeat(need // max(ids.numel(), 1) + 1)
    return ids[:need].view(batch, prompt_len)


@dataclass(frozen=True)
class LatencyOptions:
    """What `measure_latency` times: prompts of `prompt_len` tokens, `gen_len` new tokens, each batch size
    (batch 1 always), `warmup` untimed runs then `repeats` timed ones."""

    prompt_len: int
    gen_len: int
    batch_sizes: tuple[int, ...]
    repeats: int
    warmup: int

    @classmethod
    def of(cls, options: Any) -> "LatencyOptions":
        """From an eval stage's options (recipes/schema.py: EvalStage)."""
        return cls(options.prompt_len, options.gen_len, tuple(options.batch_sizes), options.repeats, options.warmup)


def measure_latency(model, ids: torch.Tensor, options: LatencyOptions, *, device: torch.device,
                    progress: Progress | None = None) -> dict:
    """TTFT and TPOT (batch 1) and throughput per batch size; prompts are cut from the token ids `ids`."""
    progress = progress or NullProgress()
    prompt_len, gen_len, batch_sizes = options.prompt_len, options.gen_len, options.batch_sizes
    repeats, warmup = options.repeats, options.warmup
    sizes = sorted(set(batch_sizes) | {1})
    runs: dict[int, list[RunTiming]] = {}
    sections: dict[str, dict] = {}
    # heap_reuse: the CLI keeps glibc's mmap threshold at 1 MB (memory.py), which would make every buffer
    # above 1 MB a fresh mmap with page faults on each call; a process serving the model has glibc's
    # default, adaptive threshold, so the timed runs reuse heap memory as it would. (On the demo model the
    # fused 3072-wide gate/up output of a 128-token prefill is 1.5 MB: without this, W8A8's TTFT in
    # eval was 1.15-1.24x fp32's; in a plain process 0.85x.)
    with progress.task("latency", len(sizes) * (warmup + repeats)) as bar, heap_reuse():
        for b in sizes:
            prompt = prompt_batch(ids, b, prompt_len)
            for _ in range(warmup):
                greedy_run(model, prompt, gen_len, device)
                bar.advance(1, batch=b)
            runs[b] = []
            before = contention.read()
            for _ in range(repeats):
                runs[b].append(greedy_run(model, prompt, gen_len, device))
                bar.advance(1, batch=b)
            sections[f"batch {b}"] = contention.between(before, contention.read())
    one = runs[1]
    throughput = {
        str(b): round(b * gen_len / percentile([r.prefill_s + r.decode_s for r in runs[b]], 50), 3)
        for b in sorted(set(batch_sizes))
    }
    ttft = summarize_ms([r.prefill_s for r in one])
    tpot = summarize_ms([r.decode_s / (gen_len - 1) for r in one]) if gen_len > 1 else None
    spreads = {"TTFT": contention.spread(ttft), "TPOT": contention.spread(tpot),
               **{f"batch-{b} run": contention.spread(summarize_ms([r.prefill_s + r.decode_s for r in runs[b]]))
                  for b in sizes if b > 1}}
    return {
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "throughput_tok_s": throughput,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "repeats": repeats,
        "warmup": warmup,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "load": {**contention.assess(sections, spreads, usable_cores(), torch.get_num_threads()),
                 "sections": sections},
    }
