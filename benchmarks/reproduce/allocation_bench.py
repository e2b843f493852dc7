"""Allocation benchmark: the same total sparsity (or average bits) spent uniformly, globally, by OWL, or
by measured sensitivity.

Protocol (benchmarks/common.py): the demo model (SmolLM2-135M); calibration windows of 512 tokens drawn
with seed 0 from ../shared/data/enwiki-sample.txt, the same ids for every row; perplexity on the first
16,384 tokens of ../shared/data/wikitext2-test.txt in 32 windows of 512. Prunable weights: every linear of
the decoder blocks. Each row runs the real `prune` stage in-process on a fresh copy of the model.

  python benchmarks/reproduce/allocation_bench.py                           # every prune row
  python benchmarks/reproduce/allocation_bench.py --rows magnitude-owl,wanda-owl
  python benchmarks/reproduce/allocation_bench.py --sensitivity out-sens/sensitivity.json --rows magnitude-sensitivity
  python -m geminicompress sensitivity smollm2-demo -o sens-gptq --data ../shared/data/enwiki-sample.txt \
      --samples 32 --options gptq:b4g64,gptq:b3g64 --measure proxy
  python benchmarks/reproduce/allocation_bench.py --rows gptq-3.5bit,gptq-b4g64 --sensitivity sens-gptq/sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, calibration_ids, eval_windows, perplexity, stage_context  # noqa: E402

ROWS = {  # label -> prune stage options (sparsity 0.4 unless given)
    "magnitude-global": {"method": "magnitude", "allocation": "global"},
    "magnitude-uniform": {"method": "magnitude", "allocation": "uniform"},
    "magnitude-owl": {"method": "magnitude", "allocation": "owl"},
    "magnitude-owl-l0.2": {"method": "magnitude", "allocation": "owl", "owl_lambda": 0.2},
    "magnitude-sensitivity": {"method": "magnitude", "allocation": "sensitivity"},
    "wanda-uniform": {"method": "wanda", "allocation": "uniform"},
    "wanda-owl": {"method": "wanda", "allocation": "owl"},
    "wanda-sensitivity": {"method": "wanda", "allocation": "sensitivity"},
}
QUANT_ROWS = {  # label -> gptq stage options
    "gptq-b4g64": {"bits": 4, "group_size": 64},
    "gptq-b3g64": {"bits": 3, "group_size": 64},
    "gptq-3.5bit": {"bits": 4, "group_size": 64,
                    "allocation": {"options": ["gptq:b4g64", "gptq:b3g64"], "target_bits": 3.5}},
}


def prune_row(demo: Path, calib: torch.Tensor, options: dict, work: Path) -> tuple[object, dict]:
    """Fresh demo model through the real prune stage (no export); returns (model, stage summary)."""
    from geminicompress.models.loading import load_model
    from geminicompress.compress.prune.config import PruneStage
    from geminicompress.runtime.stages import run_stage

    loaded = load_model(str(demo))
    stage = {"type": "prune", "sparsity": 0.4, **options}
    ctx = stage_context(demo, loaded, stage, calib, work, None)
    summary = run_stage(PruneStage(**stage), ctx)[1]
    shutil.rmtree(work, ignore_errors=True)
    return loaded.model, summary


def quant_row(demo: Path, calib: torch.Tensor, options: dict, work: Path, sensitivity: str | None) -> tuple[object, dict]:
    """Fresh demo model through the real gptq stage (fake-quantized in memory, no export); the summary's
    `stage_seconds` is the stage alone (no model loading)."""
    from geminicompress.compress.gptq.config import GPTQStage
    from geminicompress.models.loading import load_model
    from geminicompress.runtime.stages import run_stage

    loaded = load_model(str(demo))
    stage = {"type": "quantize", "method": "gptq", **options}
    if "allocation" in stage and sensitivity:
        stage["allocation"] = {**stage["allocation"], "sensitivity": sensitivity}
    ctx = stage_context(demo, loaded, stage, calib, work, work)
    t0 = time.perf_counter()
    summary = run_stage(GPTQStage(**stage), ctx)[1]
    summary = {**summary, "stage_seconds": time.perf_counter() - t0}
    shutil.rmtree(work, ignore_errors=True)
    return loaded.model, summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=32, help="calibration windows of 512 tokens")
    ap.add_argument("--eval-windows", type=int, default=32, help="perplexity windows of 512 tokens")
    ap.add_argument("--rows", default=None, help=f"comma-separated subset of {', '.join([*ROWS, *QUANT_ROWS])}")
    ap.add_argument("--sensitivity", default=None, help="sensitivity.json for the *-sensitivity rows "
                    "(default: the stage measures one on the calibration windows)")
    ap.add_argument("--name", default="allocation_bench")
    ap.add_argument("--dense-ppl", type=float, default=None, help="the dense model's perplexity on this protocol, "
                    "when already measured (benchmarks/results/prune_bench.json: 28.8195)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    demo = demo_dir()
    tok = load_model(str(demo)).tokenizer
    eval_ids = eval_windows(tok, args.eval_windows)
    calib = calibration_ids(tok, args.windows, seed=0)
    path = RESULTS / f"{args.name}.json"
    protocol = {"calibration_windows": args.windows, "seq_len": 512, "eval_windows": args.eval_windows,
                "eval_tokens": int(eval_ids.numel()), "calibration_seed": 0}
    results = json.loads(path.read_text()) if path.is_file() else {}
    if results.get("protocol") != protocol:
        results = {"protocol": protocol, "rows": {}}
    results.update(machine=machine(), versions=versions())
    if args.dense_ppl is not None:
        results["dense_ppl"] = args.dense_ppl
    if "dense_ppl" not in results:
        results["dense_ppl"] = perplexity(load_model(str(demo)).model, eval_ids)
    wanted = args.rows.split(",") if args.rows else list(ROWS)
    work = Path(tempfile.mkdtemp(prefix="alloc-bench-"))
    for label in wanted:
        if label in QUANT_ROWS:
            t0 = time.perf_counter()
            model, summary = quant_row(demo, calib, QUANT_ROWS[label], work / "out", args.sensitivity)
            ppl = perplexity(model, eval_ids)
            results["rows"][label] = {"options": QUANT_ROWS[label], "ppl": ppl,
                                      "increase_pct": 100 * (ppl / results["dense_ppl"] - 1),
                                      "allocation": summary.get("allocation"), "mixed": summary.get("mixed"),
                                      "seconds_shared_machine": round(time.perf_counter() - t0, 1),
                                      "stage_seconds_shared_machine": round(summary["stage_seconds"], 1)}
            path.write_text(json.dumps(results, indent=2) + "\n")
            print(f"{label:24s} ppl {ppl:8.2f}", flush=True)
            continue
        options = dict(ROWS[label])
        if options.get("allocation") == "sensitivity" and args.sensitivity:
            options["sensitivity"] = args.sensitivity
        t0 = time.perf_counter()
        model, summary = prune_row(demo, calib, options, work / "out")
        ppl = perplexity(model, eval_ids)
        results["rows"][label] = {
            "options": options, "achieved": summary["achieved_sparsity"], "ppl": ppl,
            "increase_pct": 100 * (ppl / results["dense_ppl"] - 1),
            "max_linear_sparsity": max(r["sparsity"] for r in summary["layers"]),
            "min_linear_sparsity": min(r["sparsity"] for r in summary["layers"]),
            "owl_layer_sparsity": summary.get("owl_layer_sparsity"),
            "predicted_drift": summary.get("predicted_drift"),
            "seconds_shared_machine": round(time.perf_counter() - t0, 1)}
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"{label:24s} {summary['achieved_sparsity']:.4f} ppl {ppl:8.2f}", flush=True)
        del model
    shutil.rmtree(work, ignore_errors=True)
    print_table(results)


def print_table(results: dict) -> None:
    print("\n| row | achieved sparsity | wikitext2 ppl | increase | linear sparsity min..max |")
    print("|---|---|---|---|---|")
    print(f"| dense | 0 | {results['dense_ppl']:.2f} | - | - |")
    for label, r in results["rows"].items():
        if "achieved" not in r:
            a = r.get("allocation") or {}
            print(f"| {label} | {a.get('average_bits', '-')} bits | {r['ppl']:.2f} | {r['increase_pct']:+.1f}% | - |")
            continue
        print(f"| {label} | {r['achieved']:.4f} | {r['ppl']:.2f} | {r['increase_pct']:+.1f}% "
              f"| {r['min_linear_sparsity']:.2f}..{r['max_linear_sparsity']:.2f} |")


if __name__ == "__main__":
    main()
