"""The engines that serve serve-bench's rows, behind one verb: `serve(row, flags, requests, concurrency, with_ppl)`
-> Served (per-request timings, perplexity of the windows when asked, the row's extra figures), or
RowRefused with the engine's reason. `flags` is the row's configuration: the stack's flags with the row's
own change (stack.py).

- HFServer: this process (hf.py's loop; assisted.py for the speculative row), models loaded once per run of
  rows that serve them, packed checkpoints on their fast kernels (torch_kernels.use_fast_kernels: STYLE 16);
- VllmServer: one vLLM engine per call, in vLLM's venv (vllm_driver.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from geminicompress.eval.api import free
from geminicompress.eval.engines.torch_kernels import use_fast_kernels
from geminicompress.eval.engines.vllm_engine import run_driver
from geminicompress.eval.engines.vllm_eval import model_path
from geminicompress.eval.quality.perplexity import perplexity
from geminicompress.eval.serving.assisted import serve_assisted
from geminicompress.eval.serving.hf import HFFlags, serve
from geminicompress.eval.serving.metrics import RequestTiming, from_vllm
from geminicompress.eval.serving.rows import Row
from geminicompress.eval.serving.workload import Request, WorkloadSpec
from geminicompress.eval.specs import stored_dtype
from geminicompress.kernels.decode_attention import attention_name
from geminicompress.models.loading import load_model


class RowRefused(Exception):
    """The engine cannot serve this row here; the message says why (shown in the row)."""


@dataclass
class Served:
    timings: list[RequestTiming]
    ppl: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Models:
    """The paths each row's model is loaded from: "base" is MODEL, the others the given outputs (None: not given)."""

    base: str
    int8: str | None = None
    int4: str | None = None
    student: str | None = None
    draft: str | None = None


class HFServer:
    """Rows in this process; one model (and the draft, for the speculative row) in memory at a time."""

    def __init__(self, models: Models, spec: WorkloadSpec, windows: torch.Tensor | None, dtype: str,
                 trust_remote_code: bool):
        self.models, self.spec, self.windows, self.dtype, self.trust = models, spec, windows, dtype, trust_remote_code
        self.loaded: dict[str, tuple] = {}  # key -> (model, kernel choice)

    def _load(self, key: str):
        path = getattr(self.models, key)
        as_dtype = stored_dtype(path) if self.dtype == "auto" else getattr(torch, self.dtype)
        model = load_model(path, dtype=as_dtype, trust_remote_code=self.trust).model.eval()
        choice = use_fast_kernels(model, next(model.parameters()).device)
        return model, choice

    def need(self, keys: list[str]) -> list:
        """[(model, kernel choice)] for `keys` (Models' fields), loaded once; the others are freed. A model with no
        fast kernel here is RowRefused."""
        for key in [k for k in self.loaded if k not in keys]:
            free(self.loaded.pop(key)[0])
        for key in keys:
            if key not in self.loaded:
                self.loaded[key] = self._load(key)
            if not self.loaded[key][1].timed:
                raise RowRefused(f"{getattr(self.models, key)}: no fast kernel here ({self.loaded[key][1].note})")
        return [self.loaded[k] for k in keys]

    def serve(self, row: Row, flags: dict, requests: list[Request], concurrency: int | None = None,
              with_ppl: bool = False) -> Served:
        """The row served to `requests` at their arrival times (or as a closed loop of `concurrency` clients;
        1: each request alone, after a warm-up that the other calls run first)."""
        flags = dict(flags)
        warmup = concurrency != 1
        draft = flags.pop("draft", False)
        loaded = self.need([row.model, "draft"] if draft else [row.model])
        model, choice = loaded[0]
        extra = {"kernel": choice.kernel, "activation_dtype": choice.activation_dtype}
        if draft:
            model.set_attn_implementation(attention_name(model, flags.get("attn", "eager")))
            max_len = self.spec.truncated_len if flags.get("truncate") else None
            timings, counts = serve_assisted(model, loaded[1][0], requests, max_len, warmup, concurrency)
            extra["acceptance"] = counts
            extra["draft_kernel"] = loaded[1][1].kernel
        else:
            timings = serve(model, requests, HFFlags(**flags), self.spec.truncated_len, self.spec.prefix_len,
                            warmup, concurrency)
        ppl = None
        if with_ppl and self.windows is not None:
            ppl = perplexity(model, self.windows, next(model.parameters()).device)
        return Served(timings, ppl, extra)

    @torch.no_grad()
    def logit_gaps(self, flags: dict, requests: list[Request], reference: list[list[int]], answers: list[list[int]],
                   divergences: list[tuple[int, int]]) -> list[float]:
        """At each (request, position) where an answer left the reference's: MODEL's logit of the reference's
        token minus its logit of the other answer's, after the prompt and the shared answer before it (one
        forward, no cache): about 0 for a float tie, large for a real disagreement."""
        model = self.need(["base"])[0][0]
        max_len = self.spec.truncated_len if flags.get("truncate") else None
        device = next(model.parameters()).device
        gaps = []
        for i, pos in divergences:
            ids = torch.tensor([requests[i].prompt(max_len) + reference[i][:pos]], device=device)
            logits = model(input_ids=ids).logits[0, -1].float()  # (V,)
            gaps.append(round(float(logits[reference[i][pos]] - logits[answers[i][pos]]), 6))
        return gaps

    def close(self) -> None:
        self.need([])


def vllm_job(flags: dict, path: str, requests: list[Request], spec: WorkloadSpec, windows: torch.Tensor | None,
             dtype: str, with_ppl: bool, alone: bool = False) -> dict:
    """One row as a driver job: an engine with the row's arguments serving the requests (with `alone`, one
    task per request, the prefix cache kept between them: requests one at a time)."""
    engine_flags = {k: v for k, v in flags.items() if k not in ("truncate", "draft")}
    max_len = spec.truncated_len if flags.get("truncate") else None
    asked = [{"prompt": r.prompt(max_len), "arrival_s": 0.0 if alone else r.arrival_s, "max_tokens": r.answer_len}
             for r in requests]
    warmup = [list(reversed(requests[0].prompt(max_len)))]
    tasks = ([{"kind": "serve", "warmup": warmup if i == 0 else [], "reset_prefix_cache": i == 0, "requests": [a]}
              for i, a in enumerate(asked)] if alone else [{"kind": "serve", "warmup": warmup, "requests": asked}])
    if with_ppl and windows is not None:
        tasks.append({"kind": "logprobs", "windows": windows.tolist()})
    need = max(spec.longest, windows.shape[1] if windows is not None else 0) + 16
    engine = {"dtype": dtype, "enforce_eager": True, "max_model_len": need, "seed": 0, **engine_flags}
    return {"model": path, "engine": engine, "tasks": tasks}


class VllmServer:
    """Every call its own vLLM engine (flags are engine arguments); perplexity through prompt_logprobs."""

    def __init__(self, models: Models, spec: WorkloadSpec, windows: torch.Tensor | None, dtype: str, python: str):
        self.models, self.spec, self.windows, self.dtype, self.python = models, spec, windows, dtype, python

    def serve(self, row: Row, flags: dict, requests: list[Request], concurrency: int | None = None,
              with_ppl: bool = False) -> Served:
        """As HFServer.serve; the driver takes arrival times only, so of closed loops only concurrency 1."""
        if concurrency not in (None, 1):
            raise RowRefused("a closed loop (--concurrency) is not wired for vLLM here")
        alone = concurrency == 1
        path = model_path(getattr(self.models, row.model))
        result = run_driver(self.python, vllm_job(flags, path, requests, self.spec, self.windows, self.dtype,
                                                  with_ppl, alone))
        if result.get("error"):
            raise RowRefused(f"vLLM refused it: {result['error']}")
        tasks = result["tasks"]
        served = [t for t in tasks if "requests" in t]
        timings = [from_vllm(r, t["start_wall"]) for t in served for r in t["requests"]]
        ppl = None
        if len(served) < len(tasks):
            lps = tasks[-1]["logprobs"]  # the perplexity windows' prompt log-probs
            ppl = math.exp(-sum(map(sum, lps)) / sum(map(len, lps)))
        return Served(timings, ppl, {"vllm_kernels": result.get("kernels")})

    def close(self) -> None:
        pass
