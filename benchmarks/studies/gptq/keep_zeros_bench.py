"""GPTQ on a pruned model: does it keep the zeros? The default (`--no-keep-zeros`) vs `--keep-zeros`, one run.

Protocol (the project's): SmolLM2-135M demo; SparseGPT 50% (per linear) then GPTQ 4-bit (default group
size, 64 on the demo), both calibrated on the same windows of 512 tokens drawn with seed 0 from
../shared/data/enwiki-sample.txt; perplexity on the first 16,384 tokens of
../shared/data/wikitext2-test.txt in 32 windows of 512. Sparsity is counted from each written checkpoint
as loaded back (decoder linears, dequantized): the fraction of exact zeros overall, and the lowest per
linear. Every step is the CLI in a child process, as a user runs it.

  python benchmarks/studies/gptq/keep_zeros_bench.py --work SCRATCH [--samples 32]

Prints a table and writes benchmarks/results/keep_zeros_bench.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, RESULTS, eval_windows, perplexity, run_child  # noqa: E402


def measure(path: Path) -> tuple[dict, float]:
    """({overall, lowest per linear, linears}, perplexity) of the checkpoint at path."""
    from geminicompress.models.loading import load_model

    loaded = load_model(str(path), dtype=torch.float32)
    zeros = params = 0
    lowest = 1.0
    count = 0
    for name, module in loaded.model.named_modules():
        if ".layers." in name and name.endswith("proj"):
            w = module.weight
            z = int((w == 0).sum())
            zeros += z
            params += w.numel()
            lowest = min(lowest, z / w.numel())
            count += 1
    ppl = perplexity(loaded.model, eval_windows(loaded.tokenizer))
    return {"overall": round(zeros / params, 5), "lowest_linear": round(lowest, 5), "linears": count}, round(ppl, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir

    demo = demo_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="gc-keep-zeros-"))
    work.mkdir(parents=True, exist_ok=True)
    cal = ["--data", str(DATA / "enwiki-sample.txt"), "--samples", str(args.samples), "--calib-seq-len", "512",
           "--device", "cpu", "--force", "--quiet"]
    gm = [sys.executable, "-m", "geminicompress"]
    pruned = work / "pruned"
    wall, _, _ = run_child([*gm, "prune", demo, "-o", pruned, "--method", "sparsegpt", "--sparsity", "0.5",
                            "--scope", "layer", *cal], {"OMP_NUM_THREADS": "2"})
    rows = []
    sp, ppl = measure(pruned)
    rows.append({"row": "sparsegpt 50%", "flags": "", "ppl": ppl, "sparsity": sp, "seconds": round(wall, 1)})
    for flags in ([], ["--keep-zeros"]):
        out = work / ("gptq-keep" if flags else "gptq-default")
        wall, _, _ = run_child([*gm, "quantize", pruned, "-o", out, "--method", "gptq", "--bits", "4", *flags, *cal],
                               {"OMP_NUM_THREADS": "2"})
        sp, ppl = measure(out)
        rows.append({"row": "then gptq 4-bit", "flags": " ".join(flags) or "(default)", "ppl": ppl, "sparsity": sp,
                     "seconds": round(wall, 1)})
    print(f"{'row':<18} {'flags':<20} {'ppl':>8} {'zeros':>8} {'lowest linear':>14}")
    for r in rows:
        print(f"{r['row']:<18} {r['flags']:<20} {r['ppl']:>8.3f} {r['sparsity']['overall']:>8.4f} "
              f"{r['sparsity']['lowest_linear']:>14.4f}")
    result = {"benchmark": "keep_zeros", "calibration": f"{args.samples} x 512 tokens, enwiki-sample.txt, seed 0",
              "perplexity": "wikitext2-test.txt, first 16384 tokens, 32 x 512", "rows": rows,
              "machine": machine(), "versions": versions()}
    (RESULTS / "keep_zeros_bench.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
