"""Time to first token of the demo's 4-bit model in bf16 (issue #39): torch's int4 kernel for the whole
prefill against the weight dequantized once per call + one bf16 GEMM (`kernels/int4.PREFILL_ROWS`), beside
the dense bf16 model, in one process, interleaved, medians.

    python benchmarks/studies/serving/int4_ttft_bench.py --model /work/runs/gguf_f --prompts 32,64,128,256 --repeats 9

MODEL: any of our 4-bit GPTQ/AWQ outputs (loaded as `eval` loads it: `use_fast_kernels`). A run = the
forward of a prompt of P tokens of WikiText-2 with `logits_to_keep=1` + argmax (what `eval`'s TTFT times).
Run with the machine quiet. Writes benchmarks/results/int4_ttft_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import DATA, RESULTS  # noqa: E402

import geminicompress.kernels.int4 as int4  # noqa: E402
from geminicompress.eval.engines.torch_kernels import use_fast_kernels  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402


def _ttft(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="32,64,128,256")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = dict(trust_remote_code=False, allow_pickle=False, allow_nonfinite=False)
    dense = load_model("smollm2-demo", dtype=torch.bfloat16, **kw)
    q = load_model(args.model, **kw)
    choice = use_fast_kernels(q.model, torch.device("cpu"))
    text = (DATA / "wikitext2-test.txt").read_text()[:20000]
    ids_all = dense.tokenizer(text, return_tensors="pt").input_ids
    default_rows = int4.PREFILL_ROWS
    rows, out = [], {"model": args.model, "kernel": choice.kernel if hasattr(choice, "kernel") else str(choice),
                     "threads": args.threads, "default_prefill_rows": default_rows, "load_average": list(
                         __import__("os").getloadavg())}
    ways = {"dense bf16": (dense.model, None), "int4 kernel": (q.model, 1 << 30), "int4 dequant+gemm": (q.model, 1)}
    for p in [int(x) for x in args.prompts.split(",")]:
        ids = ids_all[:, :p]
        times = {k: [] for k in ways}
        for r in range(args.repeats + 2):
            for name, (model, threshold) in ways.items():
                if threshold is not None:
                    int4.PREFILL_ROWS = threshold
                t = _ttft(model, ids)
                if r >= 2:
                    times[name].append(t)
        int4.PREFILL_ROWS = default_rows
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"prompt": p, **{k: round(v, 2) for k, v in med.items()},
               "kernel_vs_dense": round(med["int4 kernel"] / med["dense bf16"], 3),
               "dequant_vs_dense": round(med["int4 dequant+gemm"] / med["dense bf16"], 3)}
        rows.append(row)
        print(f"prompt {p:>4}: dense bf16 {med['dense bf16']:.1f} ms, int4 kernel {med['int4 kernel']:.1f} "
              f"({row['kernel_vs_dense']:.2f}x), dequant+gemm {med['int4 dequant+gemm']:.1f} "
              f"({row['dequant_vs_dense']:.2f}x)")
    out["rows"] = rows
    path = RESULTS / "int4_ttft_bench.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
