"""The serving workload of `serve-bench`: N requests that share a system prefix, each with its own question,
arriving at a chosen rate. Pure: token ids in, requests out.

- prefix: the first `prefix_len` tokens of the text (every request starts with them: a system prompt);
- questions: `question_len` tokens each, consecutive distinct slices of the text after the prefix (the
  text is repeated when it is too short, and the caller is told how many slices are repeats);
- answers: exactly `answer_len` greedy tokens (EOS ignored), so every configuration does the same work;
- arrivals: a Poisson process of `rate` requests per second (exponential gaps, seeded), the first at 0;
  rate 0 means every request arrives at 0 (a burst: serve-bench's capacity pass); serve-bench's timed rows
  run at a rate chosen from the measured capacity (stack.py) unless the spec gives one;
- prompt truncation (one of the table's rows): keep the prefix and the last `max_prompt_len - prefix_len`
  tokens of each question (the end of a question is the part nearest the answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from geminicompress.core.errors import InputError


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float  # seconds after the run starts
    prefix: list[int]  # shared by every request
    question: list[int]  # this request's own tokens
    answer_len: int

    def prompt(self, max_len: int | None = None) -> list[int]:
        """prefix + question, the question cut from the left to fit `max_len` tokens in all."""
        question = self.question
        if max_len is not None and len(self.prefix) + len(question) > max_len:
            question = question[len(self.prefix) + len(question) - max_len:]
        return self.prefix + question


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 32
    prefix_len: int = 256
    question_len: int = 128
    answer_len: int = 32
    rate: float | None = None  # requests per second of the timed rows; None: a share of the measured capacity
    max_prompt_len: int | None = None  # the truncation row's prompt length (default: prefix + question / 2)
    seed: int = 0

    @property
    def truncated_len(self) -> int:
        return self.max_prompt_len or self.prefix_len + self.question_len // 2

    @property
    def longest(self) -> int:
        """Tokens a request holds at its end: the full prompt and its answer."""
        return self.prefix_len + self.question_len + self.answer_len


def check_spec(spec: WorkloadSpec, context: int | None) -> None:
    """Refuse, before any model loads, a workload the model cannot hold or that makes no sense."""
    if spec.requests < 1 or spec.prefix_len < 0 or spec.question_len < 1 or spec.answer_len < 2:
        raise InputError("--requests and --question-len must be at least 1, --answer-len at least 2, "
                         "--prefix-len at least 0")
    if spec.rate is not None and spec.rate <= 0:
        raise InputError(f"--rate must be > 0 requests per second, got {spec.rate:g}: the capacity pass already "
                         "serves every request at once (leave --rate out to run at --load x the capacity)")
    if context is not None and spec.longest > context:
        raise InputError(f"the workload needs {spec.longest} tokens per request (--prefix-len {spec.prefix_len} + "
                         f"--question-len {spec.question_len} + --answer-len {spec.answer_len}), more than the "
                         f"model's context of {context}: shorten them")
    if not spec.prefix_len < spec.truncated_len < spec.prefix_len + spec.question_len:
        raise InputError(f"--max-prompt-len {spec.truncated_len} must keep the {spec.prefix_len}-token prefix and cut "
                         f"the question: between {spec.prefix_len + 1} and {spec.prefix_len + spec.question_len - 1}")


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n arrival times in seconds: Poisson at `rate` per second starting at 0, or all 0 for rate 0."""
    if rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(round(t, 6))
        t += rng.expovariate(rate)
    return times


def build_workload(ids: torch.Tensor, spec: WorkloadSpec) -> tuple[list[Request], int]:
    """The requests from the text's token ids (N,); and how many questions repeat earlier text (0 when the
    text is long enough)."""
    need = spec.prefix_len + spec.requests * spec.question_len
    repeats = -(-(need - ids.numel()) // spec.question_len) if ids.numel() < need else 0
    if ids.numel() < need:
        ids = ids.repeat(need // max(ids.numel(), 1) + 1)
    tokens = ids.tolist()
    prefix = tokens[:spec.prefix_len]
    times = arrivals(spec.requests, spec.rate or 0.0, spec.seed)
    out = []
    for i in range(spec.requests):
        start = spec.prefix_len + i * spec.question_len
        out.append(Request(i, times[i], prefix, tokens[start:start + spec.question_len], spec.answer_len))
    return out, repeats
