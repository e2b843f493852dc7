"""A stand-in for vLLM with the surface vllm_driver.py uses (tests only: no test needs vLLM installed).

The fake engine finishes every request one step after it was added; its log-probs and timings are
simple functions of the tokens, so tests can check the driver's and the parent's arithmetic.
A model path containing "refuse" fails like vLLM refusing a checkpoint (a bare assertion)."""

import os
from dataclasses import dataclass

__version__ = os.environ.get("FAKE_VLLM_VERSION", "0.32.0")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    prompt_logprobs: int | None = None
    detokenize: bool = True
    ignore_eos: bool = False


class EngineArgs:
    def __init__(self, model, disable_log_stats=True, **kwargs):
        self.model, self.disable_log_stats, self.kwargs = model, disable_log_stats, kwargs
