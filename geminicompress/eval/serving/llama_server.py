"""serve-bench's rows in llama.cpp (`--engine llama.cpp`): each call one llama-cpp-python process on GGUF files
(the "serve" task of eval/engines/llama_driver.py: llama_serve_task.py), under llama.cpp's python; perplexity through the same driver (logprobs).

What llama-cpp-python's `Llama` can switch, row by row:

| row | in llama.cpp |
|---|---|
| original configuration | flash_attn off, the KV cache cleared before every request, one request at a time |
| prompt truncation | prompts cut to --max-prompt-len |
| FlashAttention | `flash_attn=True` |
| KV-cache reuse | the cache kept between requests: the prefix a prompt shares with it is not evaluated again |
| dynamic batching | not switchable: one `Llama` serves one sequence; batching requests is llama-server's parallel slots |
| PagedAttention | not switchable: llama.cpp's KV cache is one unified buffer, not paged |
| INT8 / INT4 / student | that model's GGUF (`--format gguf` output, or ours exported on the fly: gguf_for) |
| speculative decoding | the draft's GGUF proposes, the model verifies a batch of proposals (greedy, exact) |
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import torch

from geminicompress.core.errors import GeminiError
from geminicompress.eval.engines.llama_eval import gguf_for, run_driver
from geminicompress.eval.engines.python import run_job
from geminicompress.eval.serving.metrics import RequestTiming
from geminicompress.eval.serving.rows import Row, rows_of
from geminicompress.eval.serving.servers import Models, RowRefused, Served
from geminicompress.eval.serving.workload import Request, WorkloadSpec

DRIVER = Path(__file__).parents[1] / "engines" / "llama_driver.py"  # its "serve" task: llama_serve_task.py
DRAFT_TOKENS = 4  # proposals per verification round


def llama_rows(given: dict[str, str | None]) -> list[Row]:
    """The llama.cpp engine's rows (module docstring)."""
    steps = [({"flash_attn": False, "reuse": False}, "flash_attn=False, the KV cache cleared before every request, one "
              "request at a time"),
             ({"truncate": True}, "prompts cut to --max-prompt-len (the prefix kept)"),
             ({"flash_attn": True}, "flash_attn=True"),
             ({"reuse": True}, "the KV cache kept between requests: a prompt's shared prefix is not evaluated again"),
             ({}, "batching"), ({}, "PagedAttention"),
             ({}, "the INT8 model's GGUF"), ({}, "the INT4 model's GGUF"),
             ({}, "the distilled student's GGUF in place of the model"),
             ({"draft": True}, f"the draft's GGUF proposes {DRAFT_TOKENS} tokens, the model verifies them in one batch")]
    rows = rows_of(steps, given)
    rows[4].reason = ("llama-cpp-python's Llama serves one sequence at a time: batching requests is llama-server's "
                      "parallel slots (-np), not driven here")
    rows[5].reason = "llama.cpp's KV cache is one unified buffer: there is no paged cache to switch on"
    return rows


def _timing(rec: dict) -> RequestTiming:
    n, later = len(rec["tokens"]), len(rec["tokens"]) - rec["with_first"]
    return RequestTiming(rec["arrival_s"], rec["first_s"] - rec["arrival_s"],
                         (rec["end_s"] - rec["first_s"]) / later if later > 0 else None, rec["end_s"], n,
                         rec["prompt_tokens"], rec["cached_tokens"], rec["tokens"])


class LlamaServer:
    """Every call its own llama.cpp process; GGUF files found (or exported) once per model."""

    def __init__(self, models: Models, spec: WorkloadSpec, windows: torch.Tensor | None, python: str, threads: int,
                 work: str | None = None):
        self.models, self.spec, self.windows, self.python, self.work = models, spec, windows, python, work
        self.threads, self.files = threads, {}
        self.made = tempfile.mkdtemp(prefix="gc-serve-gguf-", dir=work)  # GGUF files exported on the fly

    def _file(self, key: str) -> str:
        if key not in self.files:
            try:
                self.files[key] = str(gguf_for(getattr(self.models, key), self.python, Path(self.made)))
            except GeminiError as exc:  # no GGUF for it (a format the exporter does not write): this row only
                raise RowRefused(f"no GGUF for {getattr(self.models, key)}: {exc}") from exc
        return self.files[key]

    def serve(self, row: Row, flags: dict, requests: list[Request], concurrency: int | None = None,
              with_ppl: bool = False) -> Served:
        max_len = self.spec.truncated_len if flags.get("truncate") else None
        task = {"kind": "serve", "model": self._file(row.model), "draft": self._file("draft") if flags.get("draft") else None,
               "threads": self.threads, "n_ctx": self.spec.longest + 16, "flash_attn": bool(flags.get("flash_attn")),
               "reuse": bool(flags.get("reuse")), "draft_tokens": DRAFT_TOKENS, "concurrency": concurrency,
               "warmup": None if concurrency == 1 else list(reversed(requests[0].prompt(max_len))),
               "requests": [{"prompt": r.prompt(max_len), "arrival_s": r.arrival_s, "max_tokens": r.answer_len}
                            for r in requests]}
        result = run_job(self.python, DRIVER, {"model": None, "threads": self.threads, "tasks": [task]}, "llama.cpp")[0]
        if result.get("error"):
            raise RowRefused(f"llama.cpp refused it: {result['error']}")
        served = result["tasks"][0]
        extra = {"llama_cpp": result.get("llama_cpp"), "gguf": task["model"]}
        if served.get("acceptance"):
            extra["acceptance"] = served["acceptance"]
        return Served([_timing(r) for r in served["requests"]], self._ppl(task["model"]) if with_ppl else None, extra)

    def _ppl(self, path: str) -> float | None:
        if self.windows is None:
            return None
        result = run_driver(self.python, {"model": path, "threads": self.threads, "n_ctx": self.windows.shape[1],
                                          "tasks": [{"kind": "logprobs", "windows": self.windows.tolist()}]})
        if result.get("error"):
            raise RowRefused(f"llama.cpp refused its perplexity windows: {result['error']}")
        lps = result["tasks"][0]["logprobs"]
        return math.exp(-sum(map(sum, lps)) / sum(map(len, lps)))

    def close(self) -> None:
        shutil.rmtree(self.made, ignore_errors=True)
