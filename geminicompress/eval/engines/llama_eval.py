"""`eval --engine llama.cpp`: every model loaded and measured by llama.cpp (llama-cpp-python), the runtime most
people who run a model on their own CPU use (directly, or through Ollama or LM Studio).

The same protocol as the in-process eval, on the same token ids (the transformers tokenizer's: llama.cpp's own
tokenizer never sees the text): perplexity over the same windows from llama.cpp's logits, top-1 agreement with the
baseline's llama.cpp run, and a KL to it over the baseline's top-k tokens plus one bin for the rest of the
vocabulary. Merging tokens into bins can only lower a KL divergence (log-sum inequality), so that figure is a
lower bound of the full KL (`kl_is_lower_bound` in the report). Latency: greedy decoding at batch 1, TTFT (the
prompt's evaluation and the first token) and TPOT (each later token), with llama.cpp's thread count recorded.

The baseline should be a float GGUF (F32 or F16) of the original; `smollm2-demo` as a model here is an F32 GGUF
that llama.cpp writes from the demo's shipped Q4_1 file (`allow_requantize`, exact: F32 holds every Q4_1 value),
cached next to the converted demo. llama.cpp runs in a child process (llama_driver.py) under its own python:
`--llama-python`, else $GEMINICOMPRESS_LLAMA_PYTHON, else this one when it imports llama_cpp.
"""

from __future__ import annotations

import math
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from geminicompress.data import pack_windows, prefix_note, read_text, text_prefix, tokenize
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.eval.cost import plan as plan
from geminicompress.eval.cost.latency import prompt_batch, summarize_ms
from geminicompress.eval.engines.python import engine_python, run_job
from geminicompress.eval.report import ReportMachine, new_entry, new_report
from geminicompress.models import demo
from geminicompress.models.loading import resolve_model
from geminicompress.host.progress import Progress
from geminicompress.eval.config import EvalStage
from geminicompress.host.threads import usable_cores

DRIVER = Path(__file__).with_name("llama_driver.py")
ENV_PYTHON = "GEMINICOMPRESS_LLAMA_PYTHON"
INSTALL = ('install llama-cpp-python (built from source, ~8 minutes): CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON '
           '-DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python, in this venv or another one passed with '
           '--llama-python (docs/serving.md)')
TOP_K = 16  # baseline tokens kept per position for the KL (plus one bin for the rest)


def find_python(given: str | None) -> str:
    """The python that runs llama.cpp: --llama-python, else $GEMINICOMPRESS_LLAMA_PYTHON, else this one if it
    imports llama_cpp; InputError (exit 2) with the install command otherwise."""
    return engine_python(given, ENV_PYTHON, "llama_cpp", "--llama-python",
                         "--engine llama.cpp needs llama-cpp-python", INSTALL)


def check_llama(python: str, timeout: float = 120.0) -> str:
    """llama-cpp-python's version under `python`; InputError with the install command when it does not import."""
    try:
        done = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"{python} cannot run llama.cpp ({type(exc).__name__}): {INSTALL}") from exc
    version = (done.stdout.strip().splitlines() or [""])[-1].strip()
    if done.returncode != 0 or not version:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise InputError(f"llama_cpp does not import under {python} ({why}): {INSTALL}")
    return version


def run_driver(python: str, job: dict) -> dict:
    """Run llama_driver.py on `job` and return its result; its output goes to a log kept only on failure."""
    return run_job(python, DRIVER, job, "llama.cpp")[0]


def demo_f32(python: str) -> Path:
    """The demo as an F32 GGUF (llama.cpp's own dequantization of the shipped Q4_1 file: exact), made once."""
    dst = demo.cache_root() / f"{demo.DEMO_ALIAS}-f32-{demo.demo_gguf_path().stat().st_size}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".partial")
        result = run_driver(python, {"model": None, "tasks": [{"kind": "quantize", "src": str(demo.demo_gguf_path()),
                                                               "dst": str(tmp), "ftype": "F32",
                                                               "allow_requantize": True}]})
        if result.get("error"):
            raise GeminiError(f"llama.cpp could not write the demo as F32: {result['error']}")
        tmp.replace(dst)
    return dst


def gguf_for(spec: str, python: str, work: Path) -> Path:
    """The GGUF file llama.cpp loads for MODEL: a .gguf as given, OUT/model.gguf of a `--format gguf` output,
    the demo as F32, any other output of ours exported on the fly (formats/gguf_export.py)."""
    source = resolve_model(spec)
    if source.kind == "gguf":
        return source.path / source.gguf_file
    if source.kind == "demo":
        return demo_f32(python)
    if source.kind == "dir" and (source.path / "model.gguf").is_file():
        return source.path / "model.gguf"
    if source.kind == "hub":
        raise InputError(f"{spec}: --engine llama.cpp loads local models (.gguf files or our outputs), not hub ids")
    try:
        from geminicompress.formats import gguf_export  # type: ignore[attr-defined]
    except ImportError:
        raise InputError(f"{spec}: --engine llama.cpp reads .gguf files; this build cannot export a directory to GGUF "
                         f"on the fly: quantize with --format gguf (it writes OUT/model.gguf)") from None
    dst = work / f"{Path(spec.rstrip('/')).name}.gguf"
    gguf_export.export(source.path, dest=dst)
    return dst


def tokenizer_for(spec: str, trust_remote_code: bool):
    """The transformers tokenizer of the baseline: a local directory's, the demo's, or read from a .gguf file."""
    tok = plan.peek_tokenizer(spec, trust_remote_code)
    if tok is None and spec.endswith(".gguf") and Path(spec).is_file():
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(Path(spec).resolve().parent), gguf_file=Path(spec).name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise InputError(f"{spec}: transformers cannot read a tokenizer from this GGUF ({exc}); give the original "
                             f"model directory as --baseline") from exc
    if tok is None:
        raise InputError(f"{spec}: --engine llama.cpp needs the baseline's tokenizer at hand (a local model or GGUF)")
    return tok


def quality_from_llama(task: dict, windows: torch.Tensor, base: dict | None) -> dict:
    """Perplexity from llama.cpp's log-probs of each window's tokens 1..T-1; against the baseline's run (`base`:
    its top1, topk_ids, topk_logprobs and perplexity): top-1 agreement and the KL(baseline || model) over the
    baseline's top-k tokens and one bin for the rest, averaged over positions (a lower bound of the full KL)."""
    nll = -sum(sum(w) for w in task["logprobs"])
    count = sum(len(w) for w in task["logprobs"])
    ppl = math.exp(nll / count)
    out = {"perplexity": round(ppl, 6), "mean_nll": round(nll / count, 8), "tokens": count,
           "windows": len(task["logprobs"]), "seq_len": int(windows.shape[1]), "kl_to_baseline": 0.0,
           "kl_is_lower_bound": True, "kl_top_k": TOP_K, "top1_agreement": 1.0, "ppl_ratio": 1.0}
    if base is not None:
        same = sum(a == b for x, y in zip(task["top1"], base["top1"]) for a, b in zip(x, y))
        p = torch.tensor(base["topk_logprobs"], dtype=torch.float64)  # (windows, T-1, k)
        q = torch.tensor(task["at_logprobs"], dtype=torch.float64)
        kl = binned_kl(p, q).flatten()
        out.update(kl_to_baseline=round(float(kl.mean()), 8), kl_p99=round(float(torch.quantile(kl, 0.99)), 8),
                   top1_agreement=round(same / count, 6), ppl_ratio=round(ppl / base["perplexity"], 6))
    return out


def binned_kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) over k bins, the k tokens whose log-probabilities are given (..., k), and one bin for the rest
    of the vocabulary (1 − Σ). ≤ the KL over the whole vocabulary (merging outcomes never raises a divergence)."""
    p, q = p_logprobs.exp(), q_logprobs.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(1e-30)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (p * (p_logprobs - q_logprobs)).sum(-1) + rest


def latency_from_runs(task: dict, options: EvalStage, threads: int) -> dict:
    """TTFT and TPOT (batch 1) from the driver's timed decode runs: TPOT per run is its mean time per token
    after the first; median and p90 over runs."""
    runs = task["runs"]
    return {"ttft_ms": summarize_ms([r["ttft_s"] for r in runs]),
            "tpot_ms": summarize_ms([sum(r["token_s"]) / len(r["token_s"]) for r in runs if r["token_s"]]),
            "throughput_tok_s": None, "prompt_len": options.prompt_len, "gen_len": options.gen_len,
            "repeats": options.repeats, "warmup": options.warmup, "threads": threads,
            "source": "llama.cpp (llama-cpp-python Llama.eval), batch 1, greedy"}


BENCH = {"pp": 512, "tg": 128}  # llama-bench's default figures: pp512, tg128


def bench_from_runs(task: dict, threads: int) -> dict:
    """llama-bench's pp512 / tg128 in tokens per second (median over runs, and every run's) at `threads`."""
    pp = [BENCH["pp"] / t for t in task["pp_s"]]
    tg = [BENCH["tg"] / t for t in task["tg_s"]]
    return {"pp512_tok_s": round(float(torch.tensor(pp).median()), 2), "tg128_tok_s": round(float(torch.tensor(tg).median()), 2),
            "pp512_runs": [round(v, 2) for v in pp], "tg128_runs": [round(v, 2) for v in tg], "threads": threads,
            "source": "llama.cpp (llama-cpp-python): pp = 512 ids in one batch from an empty context, tg = 128 "
                      "tokens one at a time from an empty context, as llama-bench times them"}


LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # blk.N.<kind>.weight


def linear_bits(path: Path, digits: int = 4) -> float | None:
    """Stored bits per weight of the file's decoder linears (blk.N.<kind>.weight, block scales included); None
    for a file that is not a GGUF (llama.cpp's own error says why)."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(path)).tensors
    except ValueError:
        return None
    bits = elems = 0
    for t in tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEAR_KINDS and parts[3] == "weight":
            bits += int(t.n_bytes) * 8
            elems += int(t.n_elements)
    return round(bits / elems, digits) if elems else None


def evaluate_llama(specs: list[str], shown: list[str], data: str, options: EvalStage, progress: Progress,
                   trust_remote_code: bool = False) -> dict:
    """Evaluate the models `specs` (the baseline first; `shown`: their names in the report) in llama.cpp; the
    report has the shape of api.evaluate's."""
    options = plan.with_device_defaults(options, torch.device("cpu"))
    python = find_python(options.llama_python)
    version = check_llama(python)  # absent: one line, exit 2, before any model loads
    skipped = [flag for flag, given in (("--tasks", options.tasks), ("--draft", options.draft)) if given]
    if skipped:
        progress.warn(f"{' and '.join(skipped)}: not run with --engine llama.cpp (they need the model in this process)")
    tok = tokenizer_for(specs[0], trust_remote_code)
    ids = tokenize(tok, read_text(data, options.text_column), options.max_tokens)
    windows = None
    if options.quality:
        seq_len = options.seq_len or plan.DEFAULT_SEQ_LEN
        prefix = text_prefix(tok, options.frame or "tokenizer", (plan.peek_config(specs[0]) or {}).get("vocab_size"))  # the tokenizer's BOS first, as in use
        plan.check_windows(ids.numel() + len(prefix), seq_len, data)
        windows = pack_windows(ids, seq_len, prefix=prefix)
    threads = usable_cores()
    with tempfile.TemporaryDirectory(prefix="gc-llama-export-") as work:
        files = {s: gguf_for(s, python, Path(work)) for s in specs}  # refusals before any model runs
        progress.info(f"plan: {len(specs)} models in llama.cpp {version} ({python}), {threads} threads"
                      + (f"; perplexity on {windows.numel():,} tokens" if windows is not None else ""))
        entries, base = [], None
        for spec, name in zip(specs, shown):
            run = _LlamaRun(python, ids, windows, options, threads, progress)
            entry, scored = _run_one(run, spec, name, files[spec], base, is_base=not entries)
            base = base if entries else scored
            entries.append(entry)
    return new_report(shown[0], data, options, entries, ReportMachine("cpu", threads), engine="llama.cpp",
                      window_prefix=prefix_note(tok, windows[0, :len(prefix)].tolist()) if windows is not None else None,
                      llama_cpp=version, llama_python=python)


@dataclass(frozen=True)
class _LlamaRun:
    """What every model of one llama.cpp evaluation shares: the python that runs llama.cpp, the text's token ids,
    the perplexity windows (None: no perplexity), the options, the thread count and the progress."""

    python: str
    ids: torch.Tensor
    windows: torch.Tensor | None
    options: EvalStage
    threads: int
    progress: Progress


def _run_one(run: _LlamaRun, spec: str, name: str, path: Path, base: dict | None, *, is_base: bool) -> tuple:
    """One model's run in llama.cpp: its report entry, and (the baseline) what later models are compared with."""
    python, ids, windows, options, threads, progress = (run.python, run.ids, run.windows, run.options, run.threads,
                                                        run.progress)
    entry = new_entry(spec, name, is_base)
    entry.update(format="gguf", dtype=None, size_mb=round(path.stat().st_size / 1e6, 3), gguf=str(path),
                 linear_bits_per_weight=linear_bits(path))
    tasks = []
    if windows is not None:
        at = None if base is None else base["topk_ids"]
        tasks.append({"kind": "logprobs", "windows": windows.tolist(), "top_k": TOP_K if is_base else 0, "at": at})
    if options.latency:
        tasks.append({"kind": "decode", "prompt": prompt_batch(ids, 1, options.prompt_len)[0].tolist(),
                      "gen_len": options.gen_len, "warmup": options.warmup, "repeats": options.repeats})
        tasks.append({"kind": "bench", **BENCH, "warmup": 1, "repeats": max(1, min(options.repeats, 5))})
    n_ctx = max(int(windows.shape[1]) if windows is not None else 0, options.prompt_len + options.gen_len,
                BENCH["pp"] if options.latency else 0) + 16
    progress.info(f"evaluating {name} in llama.cpp" + (" (baseline)" if is_base else ""))
    with progress.task(f"llama.cpp {name}", 1) as bar:
        result = run_driver(python, {"model": str(path), "threads": threads, "n_ctx": n_ctx, "tasks": tasks})
        bar.advance(1)
    entry["kernel"] = {"kernel": "llama.cpp", "activation_dtype": "f32 (8-bit quantized for quantized matmuls)",
                       "modules": {}, "timed": options.latency, "note": result.get("system_info")}
    if result.get("error"):
        entry["error"] = result["error"]
        entry["notes"].append(f"llama.cpp refused it: {result['error']} (log: {result.get('log')})")
        if is_base:
            raise GeminiError(f"baseline: llama.cpp refused {path}: {result['error']}")
        progress.warn(f"{name}: llama.cpp refused it: {result['error']}")
        return entry, None
    out, scored = list(result["tasks"]), None
    if windows is not None:
        q = out.pop(0)
        entry["quality"] = quality_from_llama(q, windows, base)
        if is_base:
            scored = {"top1": q["top1"], "topk_ids": q["topk_ids"], "topk_logprobs": q["topk_logprobs"],
                      "perplexity": entry["quality"]["perplexity"]}
    if options.latency:
        entry["latency"] = latency_from_runs(out.pop(0), options, result["threads"])
        entry["llama_bench"] = bench_from_runs(out.pop(0), result["threads"])
    entry["load_s"] = result.get("load_s")
    return entry, scored
