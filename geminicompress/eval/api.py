"""`evaluate`: compare models with a baseline on the same text and machine; used by the `eval`
command and by the `eval` recipe stage.

Order of work: read DATA once; the baseline first (perplexity, caching its log-probs per window,
latency, footprint); then each model in turn, loaded, measured and freed, so at most two models are
in memory (two only when the baseline's log-probs do not fit the disk cache and it must recompute).
A model that fails (does not load, too short a context, ...) gets one warning line and a note in
the report; the other models are still evaluated. Only a baseline that does not load stops the run.

A model bigger than memory (or any model with `stream=True`) is not loaded: its windows go through one
decoder layer at a time read from disk (streamed.py), scored by the same meters; no latency for it.
"""

from __future__ import annotations

import copy
import gc
from contextlib import closing, contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from geminicompress.data import pack_windows, prefix_note, read_text, text_prefix, tokenize, vocab_of
from geminicompress.core.errors import GeminiError
from geminicompress.eval.cost import plan
from geminicompress.eval.cost.footprint import (
    PeakMemory,
    count_params,
    masks_size_mb,
    prune_masks_path,
    quantization_zeros,
    tensor_mb,
    weight_sparsity,
    weights_size_mb,
)
from geminicompress.eval.cost.latency import LatencyOptions, measure_latency
from geminicompress.eval.engines import torch_kernels as kernels
from geminicompress.eval.extras import run_speculative, run_tasks, tasks_available
from geminicompress.eval.quality.baseline_cache import BaselineCache
from geminicompress.eval.quality.scoring import score_windows
from geminicompress.eval.quality.streamed import open_streamed, params_of, stream_reason, streamed_logprobs
from geminicompress.eval.report import ReportMachine, new_entry, new_report, write_report
from geminicompress.eval.specs import display_names, stored_dtype
from geminicompress.eval.table import describe_timing
from geminicompress.models import demo
from geminicompress.models.head import window_chunks
from geminicompress.models.loading import LoadedModel, load_model, load_tokenizer
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.eval.config import EvalStage


@dataclass
class Baseline:
    """What later models are compared with."""

    tokenizer: object
    ids: torch.Tensor  # (N,) the evaluated text's token ids
    windows: torch.Tensor | None  # (n, T) or None when the text is too short
    cache: BaselineCache | None
    perplexity: float | None


@dataclass
class _Kept:
    """A baseline measured once and reused by later `evaluate` calls on the same baseline, data and options."""

    key: tuple | None = None
    entry: dict | None = None
    state: Baseline | None = None

    def close(self) -> None:
        if self.state is not None and self.state.cache is not None:
            self.state.cache.close()
        self.key = self.entry = self.state = None


_KEPT: ContextVar[_Kept | None] = ContextVar("kept_baseline", default=None)


@contextmanager
def baseline_kept() -> Iterator[None]:
    """Within this block, `evaluate` measures a baseline once and reuses its figures and cached log-probs
    while the baseline, data, options and device stay the same (tune's rounds: each round's OUT against the
    same input model). Only a baseline whose log-probs went to the disk cache (or that has none) is kept: one
    that would have to recompute would keep its model in memory between calls."""
    kept = _Kept()
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)
        kept.close()


def model_context(model) -> int | None:
    return plan.config_context({key: getattr(model.config, key, None) for key in plan.CONTEXT_KEYS})


def weights_path(loaded: LoadedModel) -> Path | None:
    src = loaded.source
    if src.kind == "demo":
        return demo.demo_cache_dir()
    if src.kind == "gguf":
        return src.path / src.gguf_file
    return src.path


def same_tokenizer(a, b, text: str) -> bool:
    """Equal vocabularies that also split the start of the evaluated text identically."""
    return a.get_vocab() == b.get_vocab() and torch.equal(tokenize(a, text, 4096), tokenize(b, text, 4096))


def free(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class EvalSetup:
    """Where and how `evaluate` loads the models. device: None for the GPU when there is one. names: the name
    shown for a spec (default: display_names). stream: evaluate one decoder layer at a time from disk: True,
    False, or None for the models whose weights exceed half of the available memory (streamed.py)."""

    device: torch.device | None = None
    names: dict[str, str] | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    stream: bool | None = None


@dataclass(frozen=True)
class _Run:
    """What every model of one `evaluate` call is measured with."""

    text: str
    options: EvalStage
    device: torch.device
    progress: Progress
    load: dict  # load_model's trust_remote_code and allow_pickle


def evaluate(models: list[str], baseline: str, data: str, out_dir: Path | None, options: EvalStage,
             progress: Progress | None = None, setup: EvalSetup | None = None) -> dict:
    """Evaluate `baseline` and `models`; return the report (and write it to `out_dir` when given).
    setup: where and how the models are loaded (`EvalSetup`; None: its defaults)."""
    setup = setup if setup is not None else EvalSetup()
    progress = progress or NullProgress()
    specs = list(dict.fromkeys([baseline, *models]))
    shown = [(setup.names or {}).get(s, n) for s, n in zip(specs, display_names(specs))]
    if options.engine in ("vllm", "llama.cpp"):  # every model measured by that engine, in its own process
        report = _in_engine(specs, shown, data, options, progress, setup.trust_remote_code)
    else:
        report = _in_torch(specs, shown, data, options, progress, setup)
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def _in_engine(specs: list[str], shown: list[str], data: str, options: EvalStage, progress: Progress,
               trust_remote_code: bool) -> dict:
    """Every model measured by vLLM or llama.cpp, each in its own process (eval/engines/)."""
    if options.engine == "vllm":
        from geminicompress.eval.engines.vllm_eval import evaluate_vllm as evaluate_engine
    else:
        from geminicompress.eval.engines.llama_eval import evaluate_llama as evaluate_engine
    return evaluate_engine(specs, shown, data, options, progress, trust_remote_code)


def _in_torch(specs: list[str], shown: list[str], data: str, options: EvalStage, progress: Progress,
              setup: EvalSetup) -> dict:
    """Every model measured in this process, the baseline first (its figures are what the others compare with)."""
    baseline = specs[0]
    device = setup.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = plan.with_device_defaults(options, device)
    text = read_text(data, options.text_column)
    load = dict(trust_remote_code=setup.trust_remote_code, allow_pickle=setup.allow_pickle)
    # refuses --stream early
    streamed = {spec: stream_reason(spec, setup.stream, stored_dtype(spec)) for spec in specs}
    progress.info(_plan_line(baseline, len(specs), text, data, options, device, setup.trust_remote_code))
    if options.tasks and not tasks_available():
        progress.warn("--tasks needs lm-eval-harness (pip install 'geminicompress[lm-eval]'): downstream tasks skipped")
        options = options.model_copy(update={"tasks": []})
    run = _Run(text, options, device, progress, load)
    jobs: list[tuple[str, str, torch.dtype | None]] = [(spec, name, None) for spec, name in zip(specs, shown)]
    if streamed[baseline] is None and _dtype_baseline(specs, options):
        # the baseline again, in the dtype the int4 kernels compute in (right after it)
        same_dtype = kernels.INT4_ACTIVATION_DTYPE
        jobs.insert(1, (baseline, f"{shown[0]} @{kernels.dtype_name(same_dtype)}", same_dtype))
    key = (baseline, shown[0], data, options.model_dump_json(), str(device), setup.trust_remote_code,
           streamed[baseline])
    entries, speculative = _measure_all(run, jobs, streamed, key)
    timing_warning = describe_timing(entries)
    if timing_warning:
        progress.warn(timing_warning)
    return new_report(shown[0], data, options, entries, ReportMachine(str(device), torch.get_num_threads()),
                      timing_warning, speculative, window_prefix=entries[0].get("window_prefix"))


def _measure_all(run: _Run, jobs: list[tuple[str, str, torch.dtype | None]], streamed: dict[str, str | None],
                 key: tuple) -> tuple[list[dict], dict | None]:
    """Each job's entry (the baseline first; one measured by an earlier call in a `baseline_kept` block, with the
    same `key`, is reused), and the speculative-decoding figures when --draft asks for them."""
    progress, baseline, shown = run.progress, jobs[0][0], jobs[0][1]
    entries: list[dict] = []
    base_model, base = None, None
    memo = _KEPT.get()
    if memo is not None and memo.key == key:  # measured by an earlier call in this block
        base = memo.state
        entries.append(copy.deepcopy(memo.entry))
        jobs = jobs[1:]
        progress.info(f"{shown} (baseline): measured once in this run, reused")
    try:
        for spec, name, dtype in jobs:
            entry, kept, state = _evaluate_one(run, spec, name, base, dtype, streamed[spec])
            if base is None:
                base, base_model = state, kept
                if memo is not None and kept is None and state is not None:
                    memo.close()
                    memo.key, memo.entry, memo.state = key, copy.deepcopy(entry), state
            entries.append(entry)
        speculative = None
        if run.options.draft and streamed[baseline] is not None:
            progress.warn("--draft: the baseline is evaluated streamed (it does not fit in memory): speculative "
                          "decoding skipped")
            speculative = {"available": False, "reason": "the baseline is evaluated streamed"}
        elif run.options.draft:
            speculative = run_speculative(baseline, run.options, base, run.device, progress, run.load)
    finally:
        if base is not None and base.cache is not None and (memo is None or memo.state is not base):
            base.cache.close()
        free(base_model)
    return entries, speculative


def _plan_line(baseline: str, n_models: int, text: str, data: str, options: EvalStage, device: torch.device,
               trust_remote_code: bool) -> str:
    """Check that DATA holds a perplexity window and say what will run and for about how long,
    from the baseline's config and tokenizer alone (no weights loaded)."""
    config = plan.peek_config(baseline) or {}
    tok = plan.peek_tokenizer(baseline, trust_remote_code) if options.quality else None
    n_tokens, parts = None, [f"{n_models} model{'s' if n_models > 1 else ''}"]
    if tok is not None:
        n_tokens = tokenize(tok, text, options.max_tokens).numel()
        prefix = text_prefix(tok, options.frame or "tokenizer", config.get("vocab_size"))  # a tokenizer naming a BOS it lacks: refused here
        context = plan.config_context(config)
        seq_len = options.seq_len or min(plan.DEFAULT_SEQ_LEN, context or plan.DEFAULT_SEQ_LEN)
        if context is None or seq_len <= context:  # else each model says its context is too short
            plan.check_windows(n_tokens + len(prefix), seq_len, data)
            body = seq_len - len(prefix)
            framed = f", each window {prefix_note(tok, prefix)['prefix_tokens'][0]} + {body} text tokens" if prefix else ""
            parts.append(f"perplexity on {n_tokens // body * body:,} tokens{framed}")
    if options.latency:
        parts.append(f"latency: prompt {options.prompt_len}, {options.gen_len} new tokens, batch "
                     f"{','.join(map(str, options.batch_sizes))}, {options.warmup}+{options.repeats} runs each")
    params = plan.config_params(config)
    if params is None or (options.quality and n_tokens is None):
        return "plan: " + "; ".join(parts)
    seconds = plan.estimate_seconds(params, n_models, n_tokens or 0, options, device, torch.get_num_threads(),
                                    bytes_per_param=2 if stored_dtype(baseline) != torch.float32 else 4,
                                    layers=int(config.get("num_hidden_layers", 30)))
    where = f"{device.type} x{torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
    return f"plan: {'; '.join(parts)}; expected {plan.describe_duration(seconds)} on {where} (rough)"


def _dtype_baseline(specs: list[str], options: EvalStage) -> bool:
    """Whether a model will run on the int4 kernels and the baseline is stored in another dtype than their
    activation dtype (so that its speed is also measured at that dtype)."""
    return (options.kernels == "fast" and options.dtype_baseline and options.latency
            and stored_dtype(specs[0]) != kernels.INT4_ACTIVATION_DTYPE
            and any(kernels.expects_int4(plan.peek_config(s)) for s in specs[1:]))


def _evaluate_one(run: _Run, spec: str, name: str, base: Baseline | None, dtype: torch.dtype | None = None,
                  streamed: str | None = None) -> tuple[dict, object, Baseline | None]:
    """Measure one model: loaded into memory (in `dtype` instead of its stored dtype when given), or one decoder
    layer at a time from disk when `streamed` says why (no latency then); returns (entry, model kept for
    recomputing or None, Baseline if this is it)."""
    options, device, progress, load = run.options, run.device, run.progress, run.load
    is_base = base is None
    entry = new_entry(spec, name, is_base)
    entry["dtype_baseline"] = dtype is not None

    def note(message: str) -> None:
        entry["notes"].append(message)
        progress.warn(f"{name}: {message}")

    how = f", one layer at a time ({streamed})" if streamed else ""
    progress.info(f"evaluating {name}" + (" (baseline)" if is_base else "") + how)
    with PeakMemory(device) as peak:
        try:
            if streamed:
                ckpt, path = open_streamed(spec, load["trust_remote_code"])
                tok = load_tokenizer(str(path), load["trust_remote_code"])
            else:
                loaded = load_model(spec, dtype=dtype or stored_dtype(spec), **load)
        except GeminiError as exc:
            if is_base:
                raise type(exc)(f"baseline: {exc}") from exc  # nothing to compare with
            entry["error"] = str(exc)
            note(f"skipped: {exc}")
            return entry, None, None
        if streamed:
            stored = stored_dtype(spec)
            entry.update(format=ckpt.format or "dense", dtype=kernels.dtype_name(stored), streamed=streamed,
                         size_mb=weights_size_mb(path), masks_mb=masks_size_mb(path), params=params_of(ckpt))
            state, _ = _quality(run, ckpt.model, lambda w: streamed_logprobs(ckpt, w, device, stored, progress), tok,
                                base, entry, note)
        else:
            model, state = _in_memory(run, loaded, base, entry, note)
    entry["peak_memory_mb"] = peak.peak_mb
    if streamed:
        skipped = [what for what, asked in (("latency and throughput", options.latency),
                                            ("lm-eval tasks", options.tasks)) if asked]
        if skipped:
            note(f"{' and '.join(skipped)} not measured: evaluated one layer at a time from disk ({streamed}); "
                 "they are measured only for models loaded in memory")
        return entry, None, state
    keep = is_base and state.cache is not None and not state.cache.stored
    if keep:
        state.cache.model, state.cache.device = model, device
    else:
        free(model)
    return entry, (model if keep else None), state


def _in_memory(run: _Run, loaded: LoadedModel, base: Baseline | None, entry: dict,
               note: Callable[[str], None]) -> tuple[object, Baseline | None]:
    """The figures of a model loaded into memory: footprint, the kernel that runs it, quality, latency and
    tasks; returns (the model on `device`, Baseline if this is it)."""
    options, device = run.options, run.device
    model, path = loaded.model.to(device), weights_path(loaded)
    entry.update(format=loaded.format or "dense", dtype=kernels.dtype_name(next(model.parameters()).dtype),
                 size_mb=weights_size_mb(path), masks_mb=masks_size_mb(path), tensors_mb=tensor_mb(model),
                 params=count_params(model), sparsity=weight_sparsity(model, prune_masks_path(path)),
                 quant_zeros=quantization_zeros(model))
    choice = kernels.use_fast_kernels(model, device, entry["sparsity"], reference=options.kernels != "fast")
    entry.update(kernel=asdict(choice), dtype=choice.activation_dtype)
    if choice.note and options.latency and choice.timed:
        note(choice.note)  # e.g. sparsity that runs dense here: the speed column is a dense model's
    state, ids = _quality(run, model, lambda w: (window_chunks(model, x, device) for x in w), loaded.tokenizer,
                          base, entry, note)
    need, context = options.prompt_len + options.gen_len, model_context(model)
    if options.latency and not choice.timed:
        note(f"latency not measured: {choice.note}; our dequantizing loader's timings would say nothing "
             "about the format's own kernels")
    elif options.latency and context is not None and need > context:
        note(f"--prompt-len + --gen-len = {need} is above its context of {context} tokens: latency skipped")
    elif options.latency:
        entry["latency"] = measure_latency(model, ids, LatencyOptions.of(options), device=device,
                                           progress=run.progress)
    if options.tasks:
        entry["tasks"] = run_tasks(model, loaded.tokenizer, options.tasks, device, note)
    return model, state


def _quality(run: _Run, model: Any, logprobs_of: Callable, tok: Any, base: Baseline | None, entry: dict,
             note: Callable[[str], None]) -> tuple[Baseline | None, torch.Tensor]:
    """Perplexity (+ drift when comparable) from `logprobs_of(windows)` (each window's log-probs as chunks
    (c, V) covering its T-1 scored positions, in order); `model` gives the config (a skeleton will do). Returns
    (Baseline state if this is the baseline, ids)."""
    options, text, name = run.options, run.text, entry["name"]
    if not options.quality:
        ids = tokenize(tok, text, options.max_tokens)
        return (Baseline(tok, ids, None, None, None) if base is None else None), ids
    comparable = base is not None and base.windows is not None and same_tokenizer(base.tokenizer, tok, text)
    ids = base.ids if comparable else tokenize(tok, text, options.max_tokens)
    if base is not None and not comparable and base.windows is not None:
        note("its tokenizer differs from the baseline's: KL and top-1 agreement skipped (perplexity still measured)")
    context = model_context(model)
    seq_len = options.seq_len or (base.windows.shape[1] if base is not None and base.windows is not None
                                  else min(plan.DEFAULT_SEQ_LEN, context or plan.DEFAULT_SEQ_LEN))
    windows = None
    if context is not None and seq_len > context:
        note(f"--seq-len {seq_len} is above its context of {context} tokens: perplexity skipped")
    else:
        try:
            prefix = text_prefix(tok, options.frame or "tokenizer", vocab_of(model))  # the tokenizer's BOS first, as in use
            windows = base.windows if comparable else pack_windows(ids, seq_len, prefix=prefix)
            entry["window_prefix"] = prefix_note(tok, windows[0, :len(prefix)].tolist())
        except GeminiError as exc:
            note(f"{exc}: perplexity skipped (use longer --data or a smaller --seq-len)")
    cache = None
    if windows is not None:
        if base is None:
            cache = BaselineCache(windows.shape[0], windows.shape[1] - 1, model.config.vocab_size)
        elif comparable and model.config.vocab_size != base.cache.shape[1]:
            note(f"its output vocabulary ({model.config.vocab_size}) differs from the baseline's "
                 f"({base.cache.shape[1]}): KL and top-1 agreement skipped")
            comparable = False
        elif comparable and not base.cache.stored and base.cache.model is None:
            note("KL and top-1 agreement skipped: the baseline was evaluated streamed and its log-probs "
                 f"({base.cache.window_bytes * windows.shape[0] / 2**30:.1f} GiB) do not fit the disk cache")
            comparable = False
        with closing(iter(logprobs_of(windows))) as logprobs:
            entry["quality"] = score_windows(
                logprobs, windows, label=name, store=cache, against=base.cache if comparable else None,
                base_ppl=base.perplexity if base is not None else None, progress=run.progress)
    state = Baseline(tok, ids, windows, cache, (entry["quality"] or {}).get("perplexity")) if base is None else None
    return state, ids
