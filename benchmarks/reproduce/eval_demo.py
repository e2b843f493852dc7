"""Benchmark `geminicompress eval` on the demo model (SmolLM2-135M-Instruct).

1. Perplexity: ours (geminicompress.eval) vs a plain transformers loop over the same windows
   (first 16,384 tokens of wikitext2-test.txt, 512-token non-overlapping windows) -> must agree to
   4 significant digits.
2. fp32 vs bf16 of the demo model through `evaluate` (the same code as `geminicompress eval`):
   perplexity, KL, top-1 agreement, TTFT/TPOT/throughput, memory, size.

    python benchmarks/reproduce/eval_demo.py            # full run
    python benchmarks/reproduce/eval_demo.py --quick                             # 4 windows, short timings
Writes benchmarks/results/eval_demo.json and the eval report under benchmarks/results/eval_demo/.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from geminicompress.eval.api import EvalSetup, evaluate
from geminicompress.eval.report import write_report
from geminicompress.eval.table import rich_table
from geminicompress.host.machine import machine, versions
from geminicompress.models.loading import load_model
from geminicompress.eval.config import EvalStage

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "wikitext2-test.txt"
RESULTS = ROOT / "benchmarks" / "results"


@torch.no_grad()
def plain_transformers_ppl(model, tok, text: str, max_tokens: int, seq_len: int) -> tuple[float, int]:
    """The textbook loop: tokenize, cut windows, mean of model(x, labels=x).loss, exp."""
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :max_tokens]
    n = ids.shape[1] // seq_len
    losses = [model(ids[:, i * seq_len:(i + 1) * seq_len], labels=ids[:, i * seq_len:(i + 1) * seq_len]).loss.item()
              for i in range(n)]
    return math.exp(sum(losses) / len(losses)), n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 windows, short timings")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 is steadier on a busy shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_tokens = 4 * 512 if args.quick else 16_384
    text = DATA.read_text()

    t0 = time.perf_counter()
    demo = load_model("smollm2-demo")
    ref_ppl, ref_windows = plain_transformers_ppl(demo.model, demo.tokenizer, text, max_tokens, 512)
    ref_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = Path(tmp) / "smollm2-demo-bf16"
        demo.model.to(torch.bfloat16).save_pretrained(bf16)
        demo.tokenizer.save_pretrained(bf16)
        del demo
        # Latency on a shared 2-core CPU: prompt 128, 32 new tokens, batch 1 and 4, 3 repeats (the
        # command's defaults, 512/128/1,4,8 x5, take far longer than the shared benchmark lock allows).
        opts = dict(type="eval", seq_len=512, max_tokens=max_tokens, prompt_len=128, gen_len=32,
                    batch_sizes=[1, 4], repeats=3, warmup=1)
        if args.quick:
            opts.update(prompt_len=64, gen_len=16, batch_sizes=[1, 4], repeats=2)
        t0 = time.perf_counter()
        report = evaluate([str(bf16)], "smollm2-demo", str(DATA), None, EvalStage(**opts),
                          setup=EvalSetup(device=torch.device("cpu"), names={str(bf16): "demo-bf16"}))
        eval_s = time.perf_counter() - t0
    report["models"][1]["path"] = "(temporary bf16 copy of smollm2-demo)"
    ours = report["models"][0]["quality"]["perplexity"]
    result = {
        "benchmark": "eval_demo",
        "quick": args.quick,
        "data": "wikitext2-test.txt",
        "perplexity_fp32": {"geminicompress": ours, "plain_transformers": ref_ppl, "windows": ref_windows,
                            "tokens_scored": report["models"][0]["quality"]["tokens"],
                            "agree_4_significant_digits": f"{ours:.4g}" == f"{ref_ppl:.4g}",
                            "abs_difference": abs(ours - ref_ppl)},
        "seconds": {"plain_loop_incl_load": round(ref_s, 1), "geminicompress_eval_two_models": round(eval_s, 1)},
        "eval_report": report,
        "machine": machine(),
        "versions": versions(),
        "threads": args.threads,
        "command": "python benchmarks/reproduce/eval_demo.py" + (" --quick" if args.quick else "")
        + (f" --threads {args.threads}" if args.threads != 2 else ""),
    }
    name = "eval_demo_quick" if args.quick else "eval_demo"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(report, RESULTS / name)
    from rich.console import Console

    console = Console(width=120)
    console.print(f"perplexity fp32: geminicompress {ours:.6f}  plain transformers loop {ref_ppl:.6f}  "
                  f"({ref_windows} windows of 512; agree to 4 s.d.: {result['perplexity_fp32']['agree_4_significant_digits']})")
    console.print(rich_table(report))
    console.print(f"wrote {RESULTS / name}.json and {RESULTS / name}/")


if __name__ == "__main__":
    main()
