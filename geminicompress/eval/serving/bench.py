"""`serve-bench`: the serving table. One workload (workload.py), served row after row, each row adding one
serving optimization to the row before, every row measured in the same run:

| row | transformers engine (this process, serve_hf.py) | vLLM engine (vllm_driver.py) |
|---|---|---|
| original configuration | eager attention, whole prompts, one request at a time | prefix caching off, max_num_seqs 1 |
| prompt truncation | prompts cut to --max-prompt-len | same |
| FlashAttention | attn_implementation="sdpa" | the FLASH_ATTN backend (CUDA); CPU: one backend only |
| KV-cache reuse | the shared prefix's KV cache reused | enable_prefix_caching |
| dynamic batching | waiting requests batched (--max-batch) | max_num_seqs = --max-batch |
| PagedAttention | continuous batching on the paged cache | always on in vLLM: no switch |
| INT8 | the W8A8 model (--int8) | the W8A8 model |

A row whose mechanism cannot be switched on with this engine and device is kept, with the reason, and not
measured. Rows that change the model (INT8) also get perplexity drift; every row gets the agreement of
its greedy answers with the row above's, so that what each row changed shows where it changed it
(prompt truncation changes the answers; attention kernels and batching only by float rounding).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from geminicompress import __version__
from geminicompress.data import pack_windows, read_text, prefix_note, text_prefix, tokenize
from geminicompress.errors import InputError
from geminicompress.eval.cost import plan as plan
from geminicompress.eval.engines.vllm_engine import check_vllm, find_python, run_driver
from geminicompress.eval.quality.perplexity import perplexity
from geminicompress.eval.serving.hf import HFFlags, serve
from geminicompress.eval.serving.metrics import from_vllm, summarize, token_agreement
from geminicompress.eval.serving.workload import WorkloadSpec, build_workload, check_spec
from geminicompress.eval.specs import stored_dtype
from geminicompress.machine import machine, versions
from geminicompress.progress import NullProgress, Progress

ROWS = ("original configuration", "prompt truncation", "FlashAttention", "KV-cache reuse", "dynamic batching",
        "PagedAttention", "INT8 (W8A8)")
PPL_SEQ_LEN = 512


@dataclass
class Row:
    name: str
    change: str  # what this row adds, in the engine's terms
    flags: dict = field(default_factory=dict)  # the engine flags of this row (cumulative)
    model: str = "base"  # "base" or "int8"
    reason: str | None = None  # why it is not measured (cannot be switched here)


def _cumulative(steps: list[tuple[dict, str]], int8: str | None) -> list[Row]:
    """One row per ROWS name from its (flag change, description) step, each row's flags adding its change to
    the row before's; the INT8 row is not measured without --int8."""
    rows, flags = [], {}
    for name, (change, text) in zip(ROWS, steps):
        flags = {**flags, **change}
        rows.append(Row(name, text, dict(flags), "int8" if name.startswith("INT8") else "base"))
    if int8 is None:
        rows[-1].reason = "no W8A8 model given (--int8 OUT, from `quantize MODEL -o OUT --method w8a8`)"
    return rows


def hf_rows(max_batch: int, int8: str | None) -> list[Row]:
    """The transformers engine's rows (all switchable on a CPU; INT8 needs --int8)."""
    steps = [({}, "attn_implementation=eager, whole prompts, one request at a time, DynamicCache"),
             ({"truncate": True}, "prompts cut to --max-prompt-len (the prefix kept)"),
             ({"attn": "sdpa"}, "attn_implementation=sdpa (torch's flash-attention kernel)"),
             ({"prefix_cache": True}, "the shared prefix's KV cache computed once and reused"),
             ({"max_batch": max_batch}, f"requests waiting are served together, up to {max_batch}"),
             ({"paged": True}, "transformers continuous batching (init_continuous_batching) on its paged cache, "
                               "prefix blocks shared"),
             ({}, "the W8A8 checkpoint (fbgemm INT8 GEMMs)")]
    return _cumulative(steps, int8)


def vllm_rows(max_batch: int, int8: str | None, on_cuda: bool) -> list[Row]:
    """The vLLM engine's rows: engine arguments, cumulative."""
    attn_off = {"attention_backend": "TRITON_ATTN"} if on_cuda else {}
    steps = [({**attn_off, "enable_prefix_caching": False, "max_num_seqs": 1}, "prefix caching off, max_num_seqs=1"),
             ({"truncate": True}, "prompts cut to --max-prompt-len (the prefix kept)"),
             ({"attention_backend": "FLASH_ATTN"} if on_cuda else {}, "attention_backend=FLASH_ATTN"),
             ({"enable_prefix_caching": True}, "enable_prefix_caching=True"),
             ({"max_num_seqs": max_batch}, f"max_num_seqs={max_batch}"),
             ({}, "PagedAttention"),
             ({}, "the W8A8 checkpoint")]
    rows = _cumulative(steps, int8)
    if not on_cuda:
        rows[2].reason = "vLLM's CPU build has one attention backend (CPU_ATTN), used in every row"
    rows[5].reason = "vLLM's KV cache is paged in every row: there is no switch to turn it off"
    return rows


@dataclass(frozen=True)
class ServeOptions:
    """How serve-bench serves its workload: the engine (transformers or vllm), the largest batch of the dynamic
    batching row, how many tokens of DATA the perplexity windows take, DATA's text column, the python that
    runs vLLM, the dtype the models are loaded in ("auto": as stored), whether loading may run the
    model's own code, and how prompts and windows start (`frame`: data/windows.py)."""

    engine: str = "transformers"
    max_batch: int = 8
    ppl_tokens: int = 4096
    text_column: str = "text"
    vllm_python: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    frame: str = "tokenizer"  # data/windows.py: "tokenizer" (its BOS first, where it adds one) or "text"


@dataclass(frozen=True)
class _Served:
    """One serve-bench run's model, INT8 model, workload and perplexity windows, which every row serves."""

    model: str
    int8: str | None
    requests: list
    spec: WorkloadSpec
    windows: torch.Tensor | None
    dtype: str


def serve_bench(model: str, int8: str | None, data: str, spec: WorkloadSpec, options: ServeOptions = ServeOptions(),
                progress: Progress | None = None) -> dict:
    """Measure every row on one workload; the report (serve_table.py renders it)."""
    progress = progress or NullProgress()
    engine, max_batch, ppl_tokens = options.engine, options.max_batch, options.ppl_tokens
    trust_remote_code = options.trust_remote_code
    config = plan.peek_config(model) or {}
    check_spec(spec, plan.config_context(config))  # before any model loads
    if int8 is not None:
        from geminicompress.models.loading import resolve_model

        resolve_model(int8)  # a missing --int8 folder: one line now, not after the first rows
    if max_batch < 2:
        raise InputError(f"--max-batch must be at least 2 (the dynamic batching row), got {max_batch}")
    tok = plan.peek_tokenizer(model, trust_remote_code)
    if tok is None:
        raise InputError(f"{model}: serve-bench needs a local model (directory or smollm2-demo)")
    text = read_text(data, options.text_column)
    ids = tokenize(tok, text, None)
    prefix = text_prefix(tok, options.frame, config.get("vocab_size"))  # the prompts and windows start as the tokenizer starts a text
    requests, repeated = build_workload(torch.cat([torch.tensor(prefix, dtype=ids.dtype), ids]), spec)
    windows = pack_windows(ids[:ppl_tokens], PPL_SEQ_LEN, prefix=prefix) \
        if ppl_tokens >= PPL_SEQ_LEN and ids.numel() >= PPL_SEQ_LEN else None
    served = _Served(model, int8, requests, spec, windows, options.dtype)
    if engine == "vllm":
        python = find_python(options.vllm_python)
        check_vllm(python)  # absent / too old: one line, exit 2, before any model loads
        rows = vllm_rows(max_batch, int8, torch.cuda.is_available())
        measured = run_vllm_rows(rows, served, python, progress)
    else:
        rows = hf_rows(max_batch, int8)
        measured = run_hf_rows(rows, served, progress, trust_remote_code)
    notes = [f"the text held {spec.requests - repeated} distinct questions; {repeated} repeat earlier text"] if repeated else []
    return {"geminicompress": __version__, "command": "serve-bench", "engine": engine, "model": model, "int8": int8,
            "data": data, "workload": {**asdict(spec), "truncated_len": spec.truncated_len}, "max_batch": max_batch,
            "window_prefix": prefix_note(tok, prefix),
            "rows": measured, "notes": notes, "machine": {**machine(), "torch_threads": torch.get_num_threads()},
            "versions": versions()}


def measure_rows(rows: list[Row], title: str, progress: Progress, serve_row) -> list[dict]:
    """Each row's report entry. A row without a reason is served by `serve_row(row, entry, with_ppl)`, which
    returns its request timings and, when `with_ppl` (the first measured row and the rows that change the
    model), its perplexity, else None; or None for a row the engine refused (the entry says why)."""
    out, base_ppl, above = [], None, None
    with progress.task(title, len(rows)) as bar:
        for row in rows:
            entry = {"row": row.name, "change": row.change, "flags": row.flags, "model": row.model,
                     "reason": row.reason, "metrics": None, "answer_agreement": None, "perplexity": None,
                     "ppl_drift": None}
            served = serve_row(row, entry, base_ppl is None or row.model != "base") if row.reason is None else None
            if served is not None:
                timings, ppl = served
                outputs = [t.tokens for t in timings]
                entry["metrics"] = summarize(timings)
                # its greedy answers against the last measured row above it: what this row changed
                entry["answer_agreement"] = 1.0 if above is None else token_agreement(outputs, above)
                above = outputs
                if ppl is not None:
                    base_ppl = base_ppl or ppl
                    entry["perplexity"] = round(ppl, 6)
                    if base_ppl:
                        entry["ppl_drift"] = round(ppl / base_ppl - 1.0, 6)
            out.append(entry)
            bar.advance(1, row=row.name)
    return out


# --------------------------------------------------------------------------- transformers engine


def run_hf_rows(rows: list[Row], served: _Served, progress: Progress, trust_remote_code: bool) -> list[dict]:
    """Every row in this process: the base model loaded once (and the INT8 model for its row)."""
    model, int8, requests, spec, windows, dtype = (served.model, served.int8, served.requests, served.spec,
                                                   served.windows, served.dtype)
    from geminicompress.eval.api import free
    from geminicompress.models.loading import load_model

    loaded = {}

    def serve_row(row: Row, entry: dict, with_ppl: bool):
        if row.model not in loaded:
            for key in list(loaded):
                free(loaded.pop(key))
            spec_ = model if row.model == "base" else int8
            as_dtype = stored_dtype(spec_) if dtype == "auto" else getattr(torch, dtype)
            loaded[row.model] = load_model(spec_, dtype=as_dtype, trust_remote_code=trust_remote_code).model.eval()
        m = loaded[row.model]
        progress.info(f"row {row.name}: {row.change}")
        timings = serve(m, requests, HFFlags(**row.flags), spec.truncated_len, spec.prefix_len)
        scored = windows is not None and with_ppl
        return timings, (perplexity(m, windows, next(m.parameters()).device) if scored else None)

    out = measure_rows(rows, "serving rows", progress, serve_row)
    for m in loaded.values():
        free(m)
    return out


# --------------------------------------------------------------------------- vLLM engine


def vllm_job(row: Row, path: str, requests, spec: WorkloadSpec, windows: torch.Tensor | None, dtype: str,
             with_ppl: bool) -> dict:
    """One row as a driver job: an engine with the row's arguments serving the workload."""
    flags = {k: v for k, v in row.flags.items() if k != "truncate"}
    max_len = spec.truncated_len if row.flags.get("truncate") else None
    tasks = [{"kind": "serve", "warmup": [list(reversed(requests[0].prompt(max_len)))],
              "requests": [{"prompt": r.prompt(max_len), "arrival_s": r.arrival_s, "max_tokens": r.answer_len}
                           for r in requests]}]
    if with_ppl and windows is not None:
        tasks.append({"kind": "logprobs", "windows": windows.tolist()})
    need = max(spec.longest, windows.shape[1] if windows is not None else 0) + 16
    engine = {"dtype": dtype, "enforce_eager": True, "max_model_len": need, "seed": 0, **flags}
    return {"model": path, "engine": engine, "tasks": tasks}


def run_vllm_rows(rows: list[Row], served: _Served, python: str, progress: Progress) -> list[dict]:
    """Every row as its own vLLM engine (flags are engine arguments); the first and the INT8 row also
    score the perplexity windows through prompt_logprobs."""
    model, int8, requests, spec, windows, dtype = (served.model, served.int8, served.requests, served.spec,
                                                   served.windows, served.dtype)
    from geminicompress.eval.engines.vllm_eval import model_path

    def serve_row(row: Row, entry: dict, with_ppl: bool):
        path = model_path(model if row.model == "base" else int8)
        progress.info(f"row {row.name}: {row.change}")
        result = run_driver(python, vllm_job(row, path, requests, spec, windows, dtype, with_ppl))
        if result.get("error"):
            entry["reason"] = f"vLLM refused it: {result['error']}"
            progress.warn(f"row {row.name}: {entry['reason']}")
            return None
        entry["vllm_kernels"] = result.get("kernels")
        served = result["tasks"][0]
        timings = [from_vllm(r, served["start_wall"]) for r in served["requests"]]
        if len(result["tasks"]) == 1:
            return timings, None
        lps = result["tasks"][1]["logprobs"]  # the perplexity windows' prompt log-probs
        return timings, math.exp(-sum(map(sum, lps)) / sum(map(len, lps)))

    return measure_rows(rows, "serving rows (vLLM)", progress, serve_row)
