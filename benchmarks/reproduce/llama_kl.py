"""GGUF files scored by llama.cpp itself against a reference file (the float F32 export): perplexity, KL over
the whole vocabulary (mean and 99th percentile over positions), same-top-token rate, file size.

Runs under the python that has llama-cpp-python (its own venv; numpy only besides): every window is fed as
ids (llama.cpp's tokenizer never sees the text), so each file is scored on exactly the ids our eval scores,
the tokenizer's BOS included where the windows carry it (data/windows.py). Position 0 is never a target.

    ~/venv-llama/bin/python benchmarks/reproduce/llama_kl.py --windows W.json --ref float=F32.gguf \
        --files ours=/tmp/a/model.gguf,llama=/tmp/b.gguf --out result.json
W.json: {"windows": [[ids], ...]}. Prints one line per file and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def load(path: str, threads: int, n_ctx: int):
    from llama_cpp import Llama

    return Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_threads=threads, n_batch=n_ctx, verbose=False)


def window_scores(llm, ids: list[int]) -> np.ndarray:
    """(T-1, V) float32 logits of positions 0..T-2 (each predicting the next id), copied out of llama.cpp."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids) - 1], dtype=np.float32)


CHUNK = 128  # positions whose float64 log-probs live at once: 128 x 262k x 8 B = 268 MB for Gemma 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", required=True)
    ap.add_argument("--ref", required=True, help="NAME=FILE of the reference (float) GGUF")
    ap.add_argument("--files", default="", help="NAME=FILE,... GGUF files compared with the reference")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    windows = json.loads(open(args.windows).read())["windows"]
    ref_name, ref_path = args.ref.split("=", 1)
    files = dict(item.split("=", 1) for item in args.files.split(",") if item)  # none: the reference's perplexity
    n_ctx = max(len(w) for w in windows) + 16
    ref = load(ref_path, args.threads, n_ctx)
    nll = {name: 0.0 for name in [ref_name, *files]}
    kls: dict[str, list[np.ndarray]] = {name: [] for name in files}
    same = {name: 0 for name in files}
    count = sum(len(w) - 1 for w in windows)
    for name, path in [(ref_name, None), *files.items()]:  # one file loaded at a time beside the reference
        llm = load(path, args.threads, n_ctx) if path else None  # (with logits at every position, llama.cpp
        for i, ids in enumerate(windows):  # holds GBs per model at Gemma's 262k vocabulary)
            ref_scores = window_scores(ref, ids)
            scores = window_scores(llm, ids) if llm is not None else None
            targets = np.asarray(ids[1:])
            for c in range(0, len(targets), CHUNK):
                t, rows = targets[c:c + CHUNK], np.arange(len(targets[c:c + CHUNK]))
                p = log_softmax(ref_scores[c:c + CHUNK])
                if llm is None:
                    nll[ref_name] -= p[rows, t].sum()
                    continue
                q = log_softmax(scores[c:c + CHUNK])
                nll[name] -= q[rows, t].sum()
                kls[name].append((np.exp(p) * (p - q)).sum(-1))
                same[name] += int((q.argmax(-1) == p.argmax(-1)).sum())
            print(f"{name}: window {i + 1}/{len(windows)}", file=sys.stderr, flush=True)
        del llm
    out = {"windows": len(windows), "tokens": count, "reference": ref_name,
           "rows": [{"row": ref_name, "file": ref_path, "file_mb": round(os.path.getsize(ref_path) / 1e6, 3),
                     "perplexity": round(math.exp(nll[ref_name] / count), 4)}]}
    for name, path in files.items():
        kl = np.concatenate(kls[name])
        out["rows"].append({"row": name, "file": path, "file_mb": round(os.path.getsize(path) / 1e6, 3),
                            "perplexity": round(math.exp(nll[name] / count), 4), "kl_mean": round(float(kl.mean()), 5),
                            "kl_p99": round(float(np.percentile(kl, 99)), 5),
                            "same_top1": round(same[name] / count, 5)})
    for row in out["rows"]:
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
