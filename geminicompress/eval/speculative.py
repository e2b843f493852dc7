"""Speculative decoding check: the teacher generating alone vs with the student as its draft model.

Assisted generation (Leviathan et al., 2023; transformers `assistant_model=`): the draft proposes a few
tokens greedily, the teacher verifies them in one forward pass and keeps the longest agreeing prefix
plus one token of its own. Under greedy decoding the output is exactly the teacher's, so the only
question is speed: tokens/s alone vs assisted, the speed-up, and the acceptance rate (accepted draft
tokens / proposed draft tokens), counted from the numbers transformers itself reports to its candidate
generator after each verification (`update_candidate_strategy(..., num_matches)`).

Timing: `warmup` untimed runs, then `repeats` timed runs of exactly `gen_len` new tokens (EOS disabled,
fixed budget), median reported; CUDA is synchronised around every timed run.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from geminicompress.eval.cost.latency import sync
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


@contextmanager
def count_acceptance() -> Iterator[dict]:
    """Count proposed and accepted draft tokens of every assisted generation inside the block."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    counts = {"proposed": 0, "accepted": 0, "rounds": 0}
    original = AssistedCandidateGenerator.update_candidate_strategy

    def counting(self, input_ids, scores, num_matches):
        counts["proposed"] += scores.shape[1] - 1  # scores: (B, candidates + 1, V)
        counts["accepted"] += int(num_matches)
        counts["rounds"] += 1
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = counting
    try:
        yield counts
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


@torch.no_grad()
def measure_speculative(
    teacher: Any, draft: Any, tokenizer: Any, prompt_ids: torch.Tensor, gen_len: int = 64, repeats: int = 3, warmup: int = 1
) -> dict:
    """Teacher-alone vs draft-assisted greedy generation on the same prompt (1, T) and budget.

    Returns tokens/s of both, the speed-up, the acceptance rate, and whether both produced the same
    tokens (they must, under greedy decoding, up to float ties)."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be (1, T), got {tuple(prompt_ids.shape)}")
    device = next(teacher.parameters()).device
    ids = prompt_ids.to(device)
    mask = torch.ones_like(ids)
    kwargs = _greedy_kwargs(teacher, gen_len)
    alone_t, alone_out = _timed(lambda: teacher.generate(ids, attention_mask=mask, **kwargs), device, repeats, warmup)
    with count_acceptance() as counts:
        assisted_t, assisted_out = _timed(
            lambda: teacher.generate(ids, attention_mask=mask, assistant_model=draft, tokenizer=None, **kwargs),
            device, repeats, warmup)
    alone, assisted = statistics.median(alone_t), statistics.median(assisted_t)
    return {
        "gen_len": gen_len,
        "prompt_len": int(ids.shape[1]),
        "teacher_tokens_per_s": gen_len / alone,
        "assisted_tokens_per_s": gen_len / assisted,
        "speedup": alone / assisted,
        "acceptance_rate": counts["accepted"] / max(1, counts["proposed"]),
        "accepted_per_round": counts["accepted"] / max(1, counts["rounds"]),
        "proposed_tokens": counts["proposed"] // (repeats + warmup),
        "same_output": bool(torch.equal(alone_out, assisted_out)),
        "teacher_runs_s": alone_t,
        "assisted_runs_s": assisted_t,
    }
