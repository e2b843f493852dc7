"""Run one model in vLLM and write vLLM's own measurements as JSON: the driver behind `--engine vllm`.

This file runs under vLLM's python, usually another venv (vLLM pins torch and a transformers older than
ours, docs/serving.md), so it imports only the standard library and vllm, and never geminicompress.
geminicompress runs it as `PYTHON vllm_driver.py JOB.json RESULT.json` (eval/engines/vllm_engine.py builds the
job and reads the result; the arithmetic on the figures is done there, where it is tested).

Job: {"model": DIR, "engine": {EngineArgs keyword arguments}, "tasks": [TASK, ...]}, TASK one of
- {"kind": "logprobs", "windows": [[ids], ...]}: each window's prompt log-probs (vLLM's
  `prompt_logprobs`), -> {"logprobs": [[logp of token i given tokens < i, i = 1..T-1], ...],
  "top1": [[vLLM's most likely token at each of those positions], ...]};
- {"kind": "serve", "requests": [{"prompt": [ids], "arrival_s": s, "max_tokens": n}], "warmup": [[ids]]}:
  the requests submitted at their arrival times (seconds after the start) to one engine, greedy,
  exactly `max_tokens` tokens each (EOS ignored) -> per request vLLM's RequestStateStats
  (`RequestOutput.metrics`: arrival, first-token latency, engine timestamps of the first and last token,
  generated tokens), `num_cached_tokens` (prefix-cache hits), prompt tokens, the generated ids and
  when it finished;
- {"kind": "hidden_states", "window": [ids], "path": FILE}: the residual stream after every decoder layer
  for one prompt, saved to FILE (torch.save), for a layer-by-layer comparison.
Result: {"vllm": version, "error": one line or null, "load_s": s, "tasks": [...]}. A model vLLM
refuses gives "error" with vLLM's reason and exit code 0: the caller reports it and goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def one_line(exc: BaseException) -> str:
    """vLLM's reason in one line: the message's first lines, for a bare assertion the failing line (also
    when a pydantic ValidationError wraps it: vLLM validates its config in pydantic)."""
    inner = _wrapped(exc)
    if inner is not None:
        return f"{type(exc).__name__} of {getattr(exc, 'title', None) or 'a config'}: {one_line(inner)}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "further information" not in ln]
    if lines:  # a multi-line message (a pydantic ValidationError, a list of reasons) joined
        return f"{type(exc).__name__}: {'; '.join(lines[:4])}"[:500]
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line}" if frame else ""
    return f"{type(exc).__name__}{where}"


def _wrapped(exc: BaseException) -> BaseException | None:
    """The exception a pydantic ValidationError reports (its first error's ctx), if any."""
    try:
        errors = exc.errors() if hasattr(exc, "errors") and callable(exc.errors) else []
    except Exception:
        return None
    inner = ((errors[0] if errors else {}).get("ctx") or {}).get("error")
    return inner if isinstance(inner, BaseException) else None


def _engine(model: str, engine_args: dict):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, disable_log_stats=False, **engine_args)  # stats: RequestOutput.metrics
    return LLMEngine.from_engine_args(args)


def _drain(engine) -> list:
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done


def logprobs_task(engine, task: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    for i, window in enumerate(task["windows"]):
        engine.add_request(f"w{i}", {"prompt_token_ids": window}, params)
    outs = sorted(_drain(engine), key=lambda o: int(o.request_id.lstrip("w")))
    logprobs, top1 = [], []
    for out, window in zip(outs, task["windows"]):
        lps, best = [], []
        for pos in range(1, len(window)):
            entry = out.prompt_logprobs[pos]  # {token id: Logprob}: the actual token and the rank-1 token
            lps.append(float(entry[window[pos]].logprob))
            best.append(int(next((t for t, lp in entry.items() if lp.rank == 1), window[pos])))
        logprobs.append(lps)
        top1.append(best)
    return {"logprobs": logprobs, "top1": top1}


def serve_task(engine, task: dict) -> dict:
    from vllm import SamplingParams

    for i, prompt in enumerate(task.get("warmup", [])):  # untimed: compiles, allocates, fills nothing shared
        engine.add_request(f"warm{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False))
    _drain(engine)
    if task.get("reset_prefix_cache", True) and hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()  # the warm-up's blocks must not count as hits
    reqs = sorted(enumerate(task["requests"]), key=lambda r: r[1]["arrival_s"])
    start_wall, start = time.time(), time.monotonic()
    finished: dict[str, dict] = {}
    while reqs or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while reqs and reqs[0][1]["arrival_s"] <= now:
            i, r = reqs.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
            # arrival = when the request was due, so that time spent waiting for a busy step counts
            engine.add_request(f"r{i}", {"prompt_token_ids": r["prompt"]}, params,
                               arrival_time=start_wall + r["arrival_s"])
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = _request_record(out, time.time() - start_wall)
        elif reqs:
            time.sleep(max(0.0, min(reqs[0][1]["arrival_s"] - (time.monotonic() - start), 0.05)))
    records = [finished[f"r{i}"] for i in range(len(task["requests"]))]
    return {"requests": records, "start_wall": start_wall}


def _request_record(out, finished_s: float) -> dict:
    # arrival_time: wall clock (frontend); first_token_latency: vLLM's TTFT, from arrival; the *_ts: engine-core
    # monotonic timestamps
    stats = ("arrival_time", "first_token_latency", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
             "num_generation_tokens")
    return {
        **{key: getattr(out.metrics, key, None) for key in stats},
        "num_cached_tokens": out.num_cached_tokens or 0,
        "prompt_tokens": len(out.prompt_token_ids or []),
        "output": list(out.outputs[0].token_ids),
        "finished_s": finished_s,  # seconds after the run started (wall)
    }


def hidden_states_task(engine, task: dict) -> dict:
    """The residual stream after every decoder layer for one prompt, saved with torch.save to task["path"]
    as a list of (tokens, hidden) float32 tensors: for a layer-by-layer comparison with our model.
    vLLM's decoder layers return (hidden, residual) with the residual add fused into the next norm:
    the stream is their sum."""
    import torch
    from vllm import SamplingParams

    window, captured = task["window"], {}

    def install(model):
        layers = model.model.layers

        def hook_for(i):
            def hook(module, args, out):
                h = out[0] + out[1] if isinstance(out, tuple) and out[1] is not None else (
                    out[0] if isinstance(out, tuple) else out)
                if h.shape[0] == len(window):  # the prompt's forward, not a decode step
                    captured[i] = h.detach().float().cpu()
            return hook

        model._gc_hooks = [layer.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]

    engine.apply_model(install)
    engine.add_request("h", {"prompt_token_ids": window},
                       SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    _drain(engine)
    engine.apply_model(lambda model: [h.remove() for h in model._gc_hooks])
    torch.save([captured[i] for i in sorted(captured)], task["path"])
    return {"layers": len(captured), "path": task["path"]}


TASKS = {"logprobs": logprobs_task, "serve": serve_task, "hidden_states": hidden_states_task}


def run(job: dict) -> dict:
    try:
        import vllm
    except ImportError as exc:
        return {"vllm": None, "error": f"vllm does not import: {exc}", "tasks": []}
    result = {"vllm": getattr(vllm, "__version__", "unknown"), "error": None, "load_s": None, "tasks": []}
    t0 = time.perf_counter()
    try:
        engine = _engine(job["model"], job.get("engine", {}))
    except Exception as exc:  # vLLM refused the checkpoint: its reason, in one line (the traceback to the log)
        traceback.print_exc()
        result["error"] = one_line(exc)
        return result
    result["load_s"] = round(time.perf_counter() - t0, 2)
    for task in job["tasks"]:
        try:
            result["tasks"].append(TASKS[task["kind"]](engine, task))
        except Exception as exc:
            traceback.print_exc()
            result["error"] = f"{task['kind']}: {one_line(exc)}"
            break
    return result


def main(argv: list[str]) -> int:
    job_path, result_path = argv[1], argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    # Run as a script, this file's folder is sys.path[0]: its neighbours (kernels.py, plan.py ...) would
    # shadow modules vLLM imports by the same names.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.exit(main(sys.argv))
