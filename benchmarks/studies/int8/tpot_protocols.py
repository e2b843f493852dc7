"""Why `int8_bench.py` and `geminicompress eval` report different w8a8 decode gains: both protocols on the
same two models, in one process, interleaved, at several thread counts.

The two protocols (docs/int8.md explains the difference):
- bench: `int8_bench.decode_times`: prefill a 128-token prompt, then time each of 32 decode steps
  separately; TPOT = the median over all steps of all repeats (5 rounds); 2 threads, set explicitly.
- eval:  `geminicompress.eval.cost.latency.greedy_run`: prefill the prompt, then time the whole loop of
  gen_len - 1 decode steps; TPOT = decode time / (gen_len - 1), the median of `repeats` runs; threads =
  torch's default (one per core of the machine).

    python benchmarks/studies/int8/tpot_protocols.py FP32_MODEL W8A8_DIR [--threads 1,2,4,16] [--gen-len 64] [--repeats 5]

Prints, per thread count, each model's TPOT under each protocol and the w8a8 / fp32 ratio, and writes
benchmarks/results/tpot_protocols.json. Run it alone on the machine: timings taken next to other work are
not comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import DATA, RESULTS  # noqa: E402


@torch.no_grad()
def bench_protocol(model, prompt: torch.Tensor, steps: int) -> list[float]:
    """int8_bench.py's decode timing: one sample per decode step."""
    cache_arg = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    out = model(prompt, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, use_cache=True, **{cache_arg: getattr(out, "cache", None) or out.past_key_values})
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    from geminicompress.data.windows import tokenize
    from geminicompress.eval.cost.latency import greedy_run
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("fp32")
    ap.add_argument("w8a8")
    ap.add_argument("--threads", default=f"1,2,{torch.get_num_threads()}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round of the bench protocol")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    models = {"fp32": load_model(args.fp32).model, "w8a8": load_model(args.w8a8).model}
    tok = load_model(args.fp32).tokenizer
    ids = tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), 4096)
    prompt = ids[: args.prompt_len].unsqueeze(0)  # (1, P)
    cpu = torch.device("cpu")
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        torch.set_num_threads(threads)
        per_step = {n: [] for n in models}
        per_run = {n: [] for n in models}
        for m in models.values():  # warm-up: fbgemm packing, first-call allocations
            greedy_run(m, prompt, 8, cpu)
        for _ in range(args.repeats):
            for name, m in models.items():  # interleaved, so that load drifts hit both alike
                per_step[name] += bench_protocol(m, prompt, args.steps)
                run = greedy_run(m, prompt, args.gen_len, cpu)
                per_run[name].append(run.decode_s / (args.gen_len - 1))
        row = {"threads": threads}
        for name in models:
            row[name] = {"bench_step_median_ms": 1000 * statistics.median(per_step[name]),
                         "bench_step_mean_ms": 1000 * statistics.fmean(per_step[name]),
                         "eval_run_median_ms": 1000 * statistics.median(per_run[name])}
        for key in ("bench_step_median_ms", "bench_step_mean_ms", "eval_run_median_ms"):
            row[f"ratio_{key.removesuffix('_ms')}"] = row["w8a8"][key] / row["fp32"][key]
        rows.append(row)
        print(f"threads {threads}: w8a8/fp32 TPOT  bench (per-step median) {row['ratio_bench_step_median']:.2f}x  "
              f"bench (per-step mean) {row['ratio_bench_step_mean']:.2f}x  eval (per-run) {row['ratio_eval_run_median']:.2f}x  "
              f"| fp32 {row['fp32']['eval_run_median_ms']:.1f} ms, w8a8 {row['w8a8']['eval_run_median_ms']:.1f} ms",
              flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "tpot_protocols.json"
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args), "rows": rows,
                               "machine": machine(), "versions": versions()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
