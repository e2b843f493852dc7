"""Run one GGUF model in llama.cpp (llama-cpp-python) and write llama.cpp's own figures as JSON: the driver
behind `eval --engine llama.cpp` and benchmarks/reproduce/gguf_bench.py.

This file runs under llama.cpp's python (often another venv: llama-cpp-python is built from source, docs/serving.md),
so it imports only the standard library, numpy and llama_cpp, never geminicompress. geminicompress runs it as
`PYTHON llama_driver.py JOB.json RESULT.json` (eval/engines/llama_eval.py builds the job and reads the result; the
arithmetic on the figures, perplexity and KL, is done there, where it is tested).

Job: {"model": FILE.gguf, "threads": n, "n_ctx": tokens, "tasks": [TASK, ...]}, TASK one of
- {"kind": "logprobs", "windows": [[ids], ...], "top_k": k, "at": [[[ids], ...], ...] or null}: for every
  window position i = 1..T-1, llama.cpp's log-probability of token i given the tokens before it, its most
  likely token, its k most likely tokens with their log-probabilities, and (with `at`: per window, per
  position, a list of ids, e.g. the baseline's top k) its log-probabilities of those ids
  -> {"logprobs", "top1", "topk_ids", "topk_logprobs", "at_logprobs"} (lists per window);
- {"kind": "decode", "prompt": [ids], "gen_len": n, "warmup": w, "repeats": r}: greedy decoding at batch 1,
  timed: per run the prompt's evaluation plus the first token (TTFT) and each later token (TPOT), seconds
  -> {"runs": [{"ttft_s": s, "token_s": [s, ...]}, ...]} (warm-up runs dropped);
- {"kind": "bench", "pp": 512, "tg": 128, "warmup": w, "repeats": r}: llama-bench's two figures, timed as it
  times them: `pp` prompt tokens evaluated as one batch from an empty context, and `tg` tokens generated one at
  a time from an empty context -> {"pp_s": [s, ...], "tg_s": [s, ...]} (warm-up runs dropped);
- {"kind": "quantize", "src": FILE, "dst": FILE, "ftype": "Q4_0"|..., "allow_requantize": bool,
  "imatrix": {gguf tensor name: [mean x² per input channel]} or null}: llama.cpp's own quantizer
  (`llama_model_quantize`) -> {"dst": FILE, "bytes": n}. `model` may then be null;
- {"kind": "serve", "model": FILE, "draft": FILE or null, "requests": [...], ...}: serve-bench's requests served
  one after another, timed (eval/serving/llama_serve_task.py, loaded by its path) -> {"requests", "acceptance"}.
Result: {"llama_cpp": version, "error": one line or null, "load_s": s, "threads": n, "system_info": text,
"tasks": [one result per task, in the job's order]}.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback


def _load(path: str, threads: int, n_ctx: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False, seed=0)


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logprobs_task(llm, task: dict) -> dict:
    import numpy as np

    k = int(task.get("top_k", 0))
    out = {"logprobs": [], "top1": [], "topk_ids": [], "topk_logprobs": [], "at_logprobs": []}
    for w, window in enumerate(task["windows"]):
        llm.reset()
        llm.eval(window)
        lp = _log_softmax(np.asarray(llm.scores[:len(window) - 1]))  # (T-1, vocab): position i predicts i + 1
        nxt = np.asarray(window[1:])
        out["logprobs"].append(lp[np.arange(len(nxt)), nxt].tolist())
        out["top1"].append(lp.argmax(axis=-1).tolist())
        if k:
            ids = np.argpartition(-lp, k, axis=-1)[:, :k]
            out["topk_ids"].append(ids.tolist())
            out["topk_logprobs"].append(np.take_along_axis(lp, ids, axis=-1).tolist())
        if task.get("at") is not None:
            at = np.asarray(task["at"][w])  # (T-1, k)
            out["at_logprobs"].append(np.take_along_axis(lp, at, axis=-1).tolist())
    return out


def _next(llm) -> int:
    """The argmax after the last evaluated token. llama-cpp-python fills `scores` only with logits_all (0.3.x),
    so otherwise it is read from the context's logits of the last batch's last token."""
    import numpy as np

    if llm._logits_all:
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm._n_vocab,))))


def decode_task(llm, task: dict) -> dict:
    runs = []
    for r in range(int(task.get("warmup", 1)) + int(task["repeats"])):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(task["prompt"])
        tok = _next(llm)  # the prompt's last token's logits
        t1 = time.perf_counter()
        times, tokens = [], [tok]
        for _ in range(int(task["gen_len"]) - 1):
            t = time.perf_counter()
            llm.eval([tok])
            tok = _next(llm)
            times.append(time.perf_counter() - t)
            tokens.append(tok)
        runs.append({"ttft_s": t1 - t0, "token_s": times, "tokens": tokens})
    return {"runs": runs[int(task.get("warmup", 1)):]}


def bench_task(llm, task: dict) -> dict:
    pp, tg = int(task.get("pp", 512)), int(task.get("tg", 128))
    prompt = [(i * 7919) % max(2, llm.n_vocab() - 1) + 1 for i in range(pp)]  # fixed ids, as llama-bench's random ones
    out = {"pp_s": [], "tg_s": []}
    for r in range(int(task.get("warmup", 1)) + int(task["repeats"])):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        llm.reset()
        tok = prompt[0]
        t2 = time.perf_counter()
        for _ in range(tg):
            llm.eval([tok])
            tok = _next(llm)
        t3 = time.perf_counter()
        if r >= int(task.get("warmup", 1)):
            out["pp_s"].append(t1 - t0)
            out["tg_s"].append(t3 - t2)
    return out


FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
          "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
          "IQ4_NL": 25, "IQ4_XS": 30}  # llama_ftype


def quantize_task(task: dict) -> dict:
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[task["ftype"]]
    params.allow_requantize = bool(task.get("allow_requantize", False))
    params.nthread = int(task.get("threads", 0))
    keep = []  # the imatrix arrays must live until the call returns
    if task.get("imatrix"):
        entries = sorted(task["imatrix"].items())
        arr = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, values) in enumerate(entries):
            data = np.ascontiguousarray(values, dtype=np.float32)
            keep += [name.encode(), data]
            arr[i].name = keep[-2]
            arr[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = data.size
        arr[len(entries)].name = None  # the list ends at a null name
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    code = llama_cpp.llama_model_quantize(task["src"].encode(), task["dst"].encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code} for {task['ftype']}")
    return {"dst": task["dst"], "bytes": os.path.getsize(task["dst"])}


def _serving():
    """eval/serving/llama_serve_task.py, loaded by its path (this file's folder is not on sys.path: main)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "serving", "llama_serve_task.py")
    spec = importlib.util.spec_from_file_location("llama_serve_task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._next = _next  # one reading of the next token for every task
    return module


def one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {'; '.join(lines[:3])}"[:500] if lines else type(exc).__name__


def run(job: dict) -> dict:
    try:
        import llama_cpp
    except ImportError as exc:
        return {"llama_cpp": None, "error": f"llama_cpp does not import: {exc}", "tasks": []}
    threads = int(job.get("threads") or os.cpu_count() or 1)
    result = {"llama_cpp": getattr(llama_cpp, "__version__", "unknown"), "error": None, "load_s": None,
              "threads": threads, "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
              "tasks": []}
    llm, kind = None, None  # one model at a time: with logits at every position (quality) or the last (decode)
    try:
        for task in job["tasks"]:
            if task["kind"] in ("quantize", "serve"):  # their own models: none kept open
                work = quantize_task if task["kind"] == "quantize" else _serving().serve_task
                result["tasks"].append(work({**task, "threads": threads}))
                continue
            want = "logprobs" if task["kind"] == "logprobs" else "decode"
            if kind != want:
                del llm
                t0 = time.perf_counter()
                llm, kind = _load(job["model"], threads, int(job.get("n_ctx", 512)), logits_all=want == "logprobs"), want
                result["load_s"] = result["load_s"] or round(time.perf_counter() - t0, 2)
            result["tasks"].append(logprobs_task(llm, task) if want == "logprobs" else
                                   bench_task(llm, task) if task["kind"] == "bench" else decode_task(llm, task))
    except Exception as exc:  # llama.cpp refused the file or failed: its reason, in one line (traceback to the log)
        traceback.print_exc()
        result["error"] = one_line(exc)
    return result


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[2] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(argv[2] + ".tmp", argv[2])
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # its neighbours must not shadow what llama_cpp imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.exit(main(sys.argv))
