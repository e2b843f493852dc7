"""Serve serve-bench's requests in llama.cpp (llama-cpp-python): the "serve" task of eval/engines/llama_driver.py,
the one process llama.cpp's work runs in (eval/serving/llama_server.py builds the job and reads the result).

It runs under llama.cpp's python (often another venv), so it imports only the standard library, numpy and
llama_cpp, never geminicompress; llama_driver.py loads it by its path.

Task: {"kind": "serve", "model": FILE.gguf, "draft": FILE.gguf or null, "threads": n, "n_ctx": tokens, "flash_attn": bool,
"reuse": bool, "draft_tokens": k, "warmup": [ids], "requests": [{"prompt": [ids], "arrival_s": s, "max_tokens": n}],
"concurrency": N or null}. One model, one sequence: requests are served one after another in arrival order
(each waits for its arrival time; with `concurrency` N, request i arrives when request i − N finished).
Greedy, exactly `max_tokens` tokens (EOS never chosen as a stop):
- `reuse` false: the KV cache is cleared before every request (the whole prompt is evaluated);
- `reuse` true: the cache is kept, and the longest prefix the prompt shares with what it holds is not evaluated
  again (llama.cpp's prompt cache: llama-cpp-python's own prefix match, made explicit to count the hits);
- `draft`: speculative decoding: the draft proposes `draft_tokens` tokens greedily, the model evaluates them in one
  batch and keeps the longest prefix equal to its own argmax, plus its own next token (Leviathan et al., 2023).
Result: {"requests": [{"arrival_s", "first_s",
"end_s", "with_first", "tokens", "prompt_tokens", "cached_tokens"}], "acceptance": {"proposed", "accepted",
"rounds"} or null} (seconds after the start).
"""

from __future__ import annotations

import os
import time


def _load(path: str, job: dict, logits_all: bool):
    from llama_cpp import Llama

    threads = int(job.get("threads") or os.cpu_count() or 1)
    n_ctx = int(job.get("n_ctx", 1024))
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, flash_attn=bool(job.get("flash_attn")), verbose=False, seed=0)


# the next greedy token after the last evaluated one: llama_driver._next, handed over when the driver loads this file
_next = None


def _feed(llm, tokens: list[int], reuse: bool) -> int:
    """Evaluate `tokens` as the whole context; with `reuse`, the prefix it shares with the cache is kept (at
    least the last token is evaluated, for its logits). Returns the tokens reused."""
    held = list(llm.input_ids[:llm.n_tokens]) if reuse else []
    same = 0
    for a, b in zip(held, tokens[:-1]):
        if a != b:
            break
        same += 1
    llm.n_tokens = same  # eval() drops the cache after n_tokens
    llm.eval(tokens[same:])
    return same


def _speculate(llm, draft, context: list[int], n: int, k: int, counts: dict, first) -> list[int]:
    """n greedy tokens after `context` (evaluated by `llm`), the draft proposing k at a time. Invariant: `llm`
    has evaluated everything before out[-1]; one round evaluates out[-1] and the k proposals in one batch,
    whose k + 1 argmaxes say how many proposals `llm` itself would have chosen, plus its own next token."""
    import numpy as np

    out = [_next(llm)]
    first(1)
    while len(out) < n:
        _feed(draft, context + out, reuse=True)
        proposal = [_next(draft)]
        while len(proposal) < min(k, n - len(out)):
            draft.eval([proposal[-1]])
            proposal.append(_next(draft))
        start = llm.n_tokens
        llm.eval([out[-1]] + proposal)
        own = [int(t) for t in np.argmax(llm.scores[start:start + len(proposal) + 1], axis=-1)]  # (k + 1,)
        accepted = next((i for i, (p, o) in enumerate(zip(proposal, own)) if p != o), len(proposal))
        counts["proposed"] += len(proposal)
        counts["accepted"] += accepted
        counts["rounds"] += 1
        out += proposal[:accepted] + [own[accepted]]
        llm.n_tokens = start + 1 + accepted  # the cache holds out[-1]'s predecessors only
    return out[:n]


def _greedy(llm, n: int, first) -> list[int]:
    out = [_next(llm)]
    first(1)
    while len(out) < n:
        llm.eval([out[-1]])
        out.append(_next(llm))
    return out


def serve(llm, draft, job: dict) -> dict:
    reqs = sorted(enumerate(job["requests"]), key=lambda r: (r[1]["arrival_s"], r[0]))
    conc = job.get("concurrency")
    counts = {"proposed": 0, "accepted": 0, "rounds": 0}
    if job.get("warmup"):
        _feed(llm, job["warmup"], reuse=False)
        _greedy(llm, 4, lambda _: None)
    llm.n_tokens = 0
    done: dict[int, dict] = {}
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    for pos, (i, r) in enumerate(reqs):
        arrival = r["arrival_s"] if not conc else (0.0 if pos < conc else done[reqs[pos - conc][0]]["end_s"])
        if arrival > clock():
            time.sleep(arrival - clock())
        rec = {"arrival_s": arrival, "prompt_tokens": len(r["prompt"])}

        def first(count: int, rec=rec) -> None:
            rec["first_s"], rec["with_first"] = clock(), count

        rec["cached_tokens"] = _feed(llm, r["prompt"], bool(job.get("reuse")))
        n = int(r["max_tokens"])
        tokens = (_speculate(llm, draft, r["prompt"], n, int(job.get("draft_tokens", 4)), counts, first) if draft
            else _greedy(llm, n, first))
        rec["end_s"], rec["tokens"] = clock(), tokens
        done[i] = rec
    return {"requests": [done[i] for i in range(len(job["requests"]))], "acceptance": counts if draft else None}


def serve_task(task: dict) -> dict:
    """The task's requests served (module docstring); llama.cpp's refusal raises."""
    draft = _load(task["draft"], task, logits_all=False) if task.get("draft") else None
    llm = _load(task["model"], task, logits_all=draft is not None)  # the verifier reads every drafted position
    return serve(llm, draft, task)
