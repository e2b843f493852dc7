"""Speculative decoding check: the teacher generating alone vs with the student as its draft model.

The draft proposes `k` tokens greedily, the teacher verifies them in one forward pass and keeps the longest
agreeing prefix plus one token of its own (Leviathan et al., 2023), in serve-bench's own loop
(serving/draft_loop.py: `k` draft forwards and one verification a round, both KV caches cropped back; DRAFT_TOKENS
proposals a round). Under greedy decoding the output is the teacher's (up to float ties between a k + 1-token
forward and a one-token step), so the question is speed: the teacher alone in the same loop (one forward a token)
against the teacher with the draft, the speed-up, and the acceptance rate (accepted / proposed draft tokens).
transformers' assisted generation (`generate(assistant_model=)`) was slower than the teacher alone on a CPU for
the demo: its per-round setup costs as much as a decode step of a small model (docs/serving.md).

Timing: `warmup` untimed runs, then `repeats` timed runs of exactly `gen_len` new tokens (EOS never stops
them), median reported; CUDA is synchronised around every timed run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from geminicompress.eval.cost.latency import sync
from geminicompress.eval.serving.draft_loop import DraftCounts, greedy, speculative_greedy
from geminicompress.eval.serving.rows import DRAFT_TOKENS
from geminicompress.models.loading import pad_token_id


def _greedy_kwargs(model: Any, gen_len: int) -> dict:
    return dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, num_beams=1,
                pad_token_id=pad_token_id(model))


@torch.no_grad()
def _timed(fn, device: torch.device, repeats: int, warmup: int) -> tuple[list[float], Any]:
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


def generation_speed(model: Any, prompt_ids: torch.Tensor, gen_len: int, repeats: int = 3, warmup: int = 1) -> dict:
    """Greedy generation of exactly `gen_len` tokens after prompt_ids (1, T): median seconds and tokens/s."""
    device = next(model.parameters()).device
    ids = prompt_ids.to(device)
    times, _ = _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **_greedy_kwargs(model, gen_len)),
                      device, repeats, warmup)
    median = statistics.median(times)
    return {"seconds": median, "tokens_per_s": gen_len / median, "s_per_token": median / gen_len, "runs_s": times}


@torch.no_grad()
def measure_speculative(
    teacher: Any, draft: Any, tokenizer: Any, prompt_ids: torch.Tensor, gen_len: int = 64, repeats: int = 3,
    warmup: int = 1, draft_tokens: int = DRAFT_TOKENS,
) -> dict:
    """Teacher-alone vs draft-assisted greedy generation on the same prompt (1, T) and budget, both in
    draft_loop.py's loop.

    Returns tokens/s of both, the speed-up, the acceptance rate, and whether both produced the same
    tokens (they must, under greedy decoding, up to float ties)."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be (1, T), got {tuple(prompt_ids.shape)}")
    device = next(teacher.parameters()).device
    prompt = prompt_ids[0].tolist()
    alone_t, alone_out = _timed(lambda: greedy(teacher, prompt, gen_len), device, repeats, warmup)
    counts = DraftCounts()

    def assisted() -> list[int]:
        tokens, c = speculative_greedy(teacher, draft, prompt, gen_len, draft_tokens)
        counts.add(c)
        return tokens

    assisted_t, assisted_out = _timed(assisted, device, repeats, warmup)
    alone, with_draft = statistics.median(alone_t), statistics.median(assisted_t)
    return {
        "gen_len": gen_len,
        "prompt_len": len(prompt),
        "draft_tokens": draft_tokens,
        "teacher_tokens_per_s": gen_len / alone,
        "assisted_tokens_per_s": gen_len / with_draft,
        "speedup": alone / with_draft,
        "acceptance_rate": counts.accepted / max(1, counts.proposed),
        "accepted_per_round": counts.accepted / max(1, counts.rounds),
        "proposed_tokens": counts.proposed // (repeats + warmup),
        "same_output": alone_out == assisted_out,
        "teacher_runs_s": alone_t,
        "assisted_runs_s": assisted_t,
    }
