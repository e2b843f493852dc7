"""`eval --engine vllm`: every model loaded and measured by vLLM, as the people who serve it would run it.

The same protocol as the in-process eval, on the same token ids: perplexity over the same windows through
vLLM's `prompt_logprobs` (and top-1 agreement with the baseline's vLLM run: vLLM returns the rank-1 token
at each position, not whole distributions, so there is no KL), and latency from vLLM's own request
metrics: TTFT and TPOT at batch 1, throughput for each batch size (`--prompt-len` prompts, exactly
`--gen-len` greedy tokens, EOS ignored; `--warmup` + `--repeats` runs; prefix caching off so that repeats
are not cache hits). Each model runs in the activation dtype our fast path uses for it (bf16 for the
int4 formats, else its stored dtype), so the two engines are compared at the same dtype.

A checkpoint vLLM refuses gives one warning line with vLLM's reason and a `[failed]` row; the other
models are still measured (a refused baseline stops the run: nothing to compare with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from geminicompress import formats
from geminicompress.data import pack_windows, prefix_note, read_text, text_prefix, tokenize
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.eval.cost import contention, plan
from geminicompress.eval.cost.footprint import weights_size_mb
from geminicompress.eval.cost.latency import percentile, prompt_batch, summarize_ms
from geminicompress.eval.engines import torch_kernels as kernels
from geminicompress.eval.engines.vllm_engine import check_vllm, find_python, run_driver
from geminicompress.eval.report import ReportMachine, new_entry, new_report
from geminicompress.eval.serving.metrics import from_vllm, summarize
from geminicompress.eval.specs import stored_dtype
from geminicompress.models import demo
from geminicompress.models.loading import resolve_model
from geminicompress.host.progress import Progress
from geminicompress.eval.config import EvalStage
from geminicompress.host.threads import usable_cores


def model_path(spec: str) -> str:
    """What vLLM loads for MODEL: the converted demo's folder, a local directory, or a hub id as typed."""
    source = resolve_model(spec)
    if source.kind == "demo":
        return str(demo.demo_cache_dir())
    if source.kind == "gguf":
        raise InputError(f"{spec}: --engine vllm loads model directories (or hub ids), not .gguf files")
    return str(source.path) if source.kind == "dir" else spec


def engine_dtype(spec: str) -> str:
    """The activation dtype for vLLM: our fast path's for this checkpoint (bf16 for int4 formats)."""
    if kernels.expects_int4(plan.peek_config(spec)):
        return "bfloat16"
    return kernels.dtype_name(stored_dtype(spec))


def quality_from_logprobs(logprobs: list[list[float]], top1: list[list[int]], windows: torch.Tensor,
                          base: dict | None) -> dict:
    """Perplexity from vLLM's prompt log-probs of each window's tokens 1..T-1, and top-1 agreement with the
    baseline's vLLM run (`base`: its `top1` lists and perplexity)."""
    nll = -sum(sum(w) for w in logprobs)
    count = sum(len(w) for w in logprobs)
    ppl = math.exp(nll / count)
    out = {"perplexity": round(ppl, 6), "mean_nll": round(nll / count, 8), "tokens": count,
           "windows": len(logprobs), "seq_len": int(windows.shape[1]), "kl_to_baseline": None,
           "top1_agreement": 1.0, "ppl_ratio": 1.0}  # the baseline's figures against itself
    if base is not None:
        same = sum(a == b for x, y in zip(top1, base["top1"]) for a, b in zip(x, y))
        out.update(top1_agreement=round(same / count, 6), ppl_ratio=round(ppl / base["perplexity"], 6))
    return out


def latency_tasks(ids: torch.Tensor, options: EvalStage) -> list[tuple[int, dict]]:
    """(batch size, serve task) for every warm-up and timed run, batch 1 first."""
    tasks = []
    for b in sorted(set(options.batch_sizes) | {1}):
        prompts = prompt_batch(ids, b, options.prompt_len).tolist()
        for run in range(options.warmup + options.repeats):
            task = {"kind": "serve", "requests": [{"prompt": p, "arrival_s": 0.0, "max_tokens": options.gen_len}
                                                  for p in prompts]}
            if not tasks:
                task["warmup"] = prompts[:1]
            tasks.append((b, task))
    return tasks


def latency_from_runs(runs: list[tuple[int, dict]], options: EvalStage) -> dict:
    """TTFT/TPOT (batch 1) and throughput per batch size from the serve results (warm-up runs dropped)."""
    by_batch: dict[int, list[dict]] = {}
    for b, result in runs:
        by_batch.setdefault(b, []).append(result)
    timed = {b: rs[options.warmup:] for b, rs in by_batch.items()}
    one = [from_vllm(r["requests"][0], r["start_wall"]) for r in timed[1]]
    throughput = {str(b): round(percentile([summarize([from_vllm(q, r["start_wall"]) for q in r["requests"]])
                                            ["throughput_tok_s"] for r in timed[b]], 50), 3)
                  for b in sorted(set(options.batch_sizes))}
    return {"ttft_ms": summarize_ms([t.ttft for t in one]),
            "tpot_ms": summarize_ms([t.tpot for t in one if t.tpot is not None]), "throughput_tok_s": throughput,
            "prompt_len": options.prompt_len, "gen_len": options.gen_len, "repeats": options.repeats,
            "warmup": options.warmup, "source": "vLLM RequestOutput.metrics"}


def evaluate_vllm(specs: list[str], shown: list[str], data: str, options: EvalStage, progress: Progress,
                  trust_remote_code: bool = False) -> dict:
    """Evaluate the models `specs` (the baseline first; `shown`: their names in the report) in vLLM; the report
    has the shape of api.evaluate's."""
    baseline = specs[0]
    options = plan.with_device_defaults(options, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    python = find_python(options.vllm_python)
    version = check_vllm(python)  # absent / too old: one line, exit 2, before any model loads
    skipped = [flag for flag, given in (("--tasks", options.tasks), ("--draft", options.draft)) if given]
    if skipped:
        progress.warn(f"{' and '.join(skipped)}: not run with --engine vllm (they need the model in this process)")
    paths = {s: model_path(s) for s in specs}
    dtypes = {s: engine_dtype(s) for s in specs}
    jobs = [(s, n, dtypes[s]) for s, n in zip(specs, shown)]
    if options.dtype_baseline and dtypes[baseline] != "bfloat16" and "bfloat16" in dtypes.values():
        jobs.insert(1, (baseline, f"{shown[0]} @bfloat16", "bfloat16"))
    tok = plan.peek_tokenizer(baseline, trust_remote_code)
    if tok is None:
        raise InputError(f"{baseline}: --engine vllm needs the baseline's tokenizer at hand (a local model)")
    text = read_text(data, options.text_column)
    ids = tokenize(tok, text, options.max_tokens)
    windows = None
    if options.quality:
        context = plan.config_context(plan.peek_config(baseline) or {})
        seq_len = options.seq_len or min(plan.DEFAULT_SEQ_LEN, context or plan.DEFAULT_SEQ_LEN)
        prefix = text_prefix(tok, options.frame or "tokenizer", (plan.peek_config(specs[0]) or {}).get("vocab_size"))  # the tokenizer's BOS first, as in use
        plan.check_windows(ids.numel() + len(prefix), seq_len, data)
        windows = pack_windows(ids, seq_len, prefix=prefix)
    progress.info(f"plan: {len(jobs)} runs in vLLM {version} ({python})"
                  + (f"; perplexity on {windows.numel():,} tokens" if windows is not None else ""))
    entries, base = [], None
    for spec, name, dtype in jobs:
        run = _VllmRun(python, ids, windows, options, progress)
        entry, top1 = _run_one(run, spec, name, dtype, paths[spec], base, is_base=not entries)
        base = base if entries else top1
        entries.append(entry)
    return new_report(shown[0], data, options, entries, ReportMachine("vllm", usable_cores()), engine="vllm",
                      window_prefix=prefix_note(tok, windows[0, :len(prefix)].tolist()) if windows is not None else None,
                      vllm=version, vllm_python=python)


@dataclass(frozen=True)
class _VllmRun:
    """What every model of one vLLM evaluation shares: the python that runs vLLM, the text's token ids, the
    perplexity windows (None: no perplexity), the options and the progress."""

    python: str
    ids: torch.Tensor
    windows: torch.Tensor | None
    options: EvalStage
    progress: Progress


def _run_one(run: _VllmRun, spec: str, name: str, dtype: str, path: str, base: dict | None, *,
             is_base: bool) -> tuple:
    """One model's run in vLLM: its report entry, and what a later model is compared with (its top-1 ids,
    perplexity and spec; None without perplexity windows). A baseline vLLM refuses stops the run."""
    python, ids, windows, options, progress = run.python, run.ids, run.windows, run.options, run.progress
    entry, top1 = new_entry(spec, name, is_base), None
    qc = (plan.peek_config(spec) or {}).get("quantization_config") or {}
    entry.update(format=formats.detect({"quantization_config": qc}) or "dense", dtype=dtype,
                 size_mb=weights_size_mb(Path(path)), dtype_baseline=not is_base and spec == (base or {}).get("spec"))
    tasks = ([{"kind": "logprobs", "windows": windows.tolist()}] if windows is not None else [])
    lat = latency_tasks(ids, options) if options.latency else []
    need = max(options.prompt_len + options.gen_len, int(windows.shape[1]) if windows is not None else 0) + 16
    job = {"model": path, "engine": {"dtype": dtype, "enforce_eager": True, "enable_prefix_caching": False,
                                     "max_model_len": need, "seed": 0},
           "tasks": tasks + [t for _, t in lat]}
    progress.info(f"evaluating {name} in vLLM ({dtype})" + (" (baseline)" if is_base else ""))
    before = contention.read()
    with progress.task(f"vllm {name}", 1) as bar:
        result = run_driver(python, job)
        bar.advance(1)
    section = contention.between(before, contention.read())
    entry["kernel"] = {"kernel": "vllm", "activation_dtype": dtype, "modules": {}, "timed": True,
                       "note": "; ".join(result.get("kernels", [])) or None}
    if result.get("error"):
        entry["error"], entry["vllm_log"] = result["error"], result.get("log")
        entry["notes"].append(f"vLLM refused it: {result['error']}")
        progress.warn(f"{name}: vLLM refused it: {result['error']}")
        if is_base:
            raise GeminiError(f"baseline: vLLM refused {spec}: {entry['error']}")
        return entry, None
    out = result["tasks"]
    if windows is not None:
        q = out.pop(0)
        entry["quality"] = quality_from_logprobs(q["logprobs"], q["top1"], windows, base)
        top1 = {"top1": q["top1"], "perplexity": entry["quality"]["perplexity"], "spec": spec}
    if lat:
        entry["latency"] = latency_from_runs([(b, r) for (b, _), r in zip(lat, out)], options)
        entry["latency"]["load"] = {**contention.assess({"vllm run": section}, {}, usable_cores(), usable_cores()),
                                    "sections": {"vllm run": section}}
    entry["load_s"] = result.get("load_s")
    return entry, top1
