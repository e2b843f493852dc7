"""GPTQ benchmark: ours vs round-to-nearest vs llm-compressor's GPTQ on the demo model, one run.

Protocol (the project's one benchmark protocol): SmolLM2-135M demo; calibration windows of 512 tokens
drawn with seed 0 from ../shared/data/enwiki-sample.txt (the same token ids for every method: ours
draws them through the CLI with the same function and seed, llm-compressor gets them as a file);
perplexity on the first 16,384 tokens of ../shared/data/wikitext2-test.txt in 32 windows of 512.
Settings per row: symmetric int weights, lm_head in float; ours with the flags `quantize --method gptq`
uses by default (GPTQStage's defaults: docs/gptq.md, "Defaults, and why"), plus any given with --flags;
llm-compressor with its own defaults. Ours runs as the CLI in a child process
(`geminicompress quantize ... --format gptq`), llm-compressor in its own venv (gptq_llmc_ref.py,
compressed-tensors output); both checkpoints are evaluated with our loaders and the same perplexity
code. Peak RSS is the child process's own maximum resident set, the whole run included (measured
through peak_rss.py: a child's ru_maxrss would include this parent's peak).
--calib-dtypes float32,bfloat16 adds our bf16-calibration rows; --llmc-dtypes float32,bfloat16 adds
llm-compressor on the model loaded in bf16 (it calibrates in the model's dtype), so that a bf16 speed-up
is compared with the reference's own bf16 speed-up too.

  python benchmarks/reproduce/gptq_bench.py            # 128 windows, w4-pc and w3-g64
  python benchmarks/reproduce/gptq_bench.py --quick    # 8 windows, ppl on 8 windows
  python benchmarks/reproduce/gptq_bench.py --samples 32 --settings w4-g64,w4-pc,w3-g64 --skip-llmc --name gptq_bench_defaults
  python benchmarks/reproduce/gptq_bench.py ... --flags="--no-act-order --first-token-weight 1"   # the former defaults
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    DATA,
    RESULTS,
    ROOT,
    calibration_ids,
    ensure_llmc_venv,
    eval_windows,
    perplexity,
    round_to_nearest,
    run_child,
)

SETTINGS = {"w4-pc": (4, -1), "w3-g64": (3, 64), "w4-g64": (4, 64)}
OURS = {"float32": "ours GPTQ", "bfloat16": "ours GPTQ, bf16 calibration"}
LLMC = {"float32": "llm-compressor GPTQ", "bfloat16": "llm-compressor GPTQ, bf16 model"}


def rtn_model(demo: Path, bits: int, group: int):
    from geminicompress.models.loading import load_model

    return round_to_nearest(load_model(str(demo)).model, bits, group, sym=True)


def ours(demo: Path, out: Path, bits: int, group: int, samples: int, calib_dtype: str, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "geminicompress", "quantize", str(demo), "-o", str(out), "--method", "gptq",
           "--bits", str(bits), "--group-size", str(group), *flags,
           "--data", str(DATA / "enwiki-sample.txt"), "--samples", str(samples), "--calib-seq-len", "512",
           "--calib-dtype", calib_dtype, "--format", "gptq", "--device", "cpu", "--force", "--quiet"]
    wall, rss, _ = run_child(cmd, {"OMP_NUM_THREADS": "2"})
    report = json.loads((out / "report.json").read_text())
    stage = report["stages"][0]
    return {"flags": flags, "quantize_seconds": stage["seconds"], "export_seconds": report["export"]["seconds"],
            "process_seconds": round(wall, 1), "peak_rss_gib": round(rss, 3),
            "layer_errors": [round(layer["err"], 4) for layer in stage["result"]["layers"]]}


def llmc(demo: Path, ids_file: Path, out: Path, bits: int, group: int, dtype: str) -> dict:
    python = ensure_llmc_venv()
    cmd = [str(python), str(ROOT / "benchmarks" / "reproduce" / "gptq_llmc_ref.py"), "--model", str(demo), "--ids", str(ids_file),
           "--bits", str(bits), "--group-size", str(group), "--out", str(out), "--dtype", dtype]
    wall, rss, text = run_child(cmd, {"OMP_NUM_THREADS": "2"})
    line = [ln for ln in text.splitlines() if ln.startswith("{")][-1]
    return {"quantize_seconds": round(json.loads(line)["seconds"], 1), "process_seconds": round(wall, 1),
            "peak_rss_gib": round(rss, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 calibration windows, perplexity on 8 windows")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--settings", default="w4-pc,w3-g64")
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--reuse-llmc", default=None, metavar="JSON",
                    help="take the llm-compressor rows from an earlier results file of the same protocol and "
                         "machine instead of re-running them (marked in the rows)")
    ap.add_argument("--calib-dtypes", default="float32",
                    help="ours: one row per calibration dtype (float32, bfloat16); the solver is float32 in both")
    ap.add_argument("--llmc-dtypes", default="float32",
                    help="llm-compressor: one row per model dtype it is loaded in (float32, bfloat16)")
    ap.add_argument("--flags", default="", help="extra quantize flags for our rows (default: none, the defaults)")
    ap.add_argument("--name", default=None, help="results file name without .json (default gptq_bench[_quick])")
    ap.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    samples = 8 if args.quick else args.samples
    demo = demo_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="gc-gptq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    base = load_model(str(demo))
    tok = base.tokenizer
    ids = calibration_ids(tok, samples)
    ids_file = work / "calibration_ids.pt"
    torch.save(ids, ids_file)
    eval_ids = eval_windows(tok, 8 if args.quick else None)
    fp32_bytes = sum(p.numel() * 4 for p in base.model.parameters())
    fp32_ppl = round(perplexity(base.model, eval_ids), 3)
    del base
    rows: list[dict] = []

    name = f"{args.name}.json" if args.name else "gptq_bench_quick.json" if args.quick else "gptq_bench.json"
    path = RESULTS / name
    meta = {
        "benchmark": "gptq", "quick": args.quick, "calibration": f"{samples} x 512 tokens, enwiki-sample.txt, seed 0",
        "perplexity": f"wikitext2-test.txt, first {eval_ids.numel()} tokens, {len(eval_ids)} x 512",
        "fp32_model_gib": round(fp32_bytes / 2**30, 3),
        "machine": machine(), "versions": versions(), "python": platform.python_version(), "threads": 2,
    }

    rows.append({"setting": "fp32", "method": "none", "ppl": fp32_ppl})

    def record(row: dict) -> None:
        """Print and write after every row: a long run that is cut short keeps what it measured."""
        rows.append(row)
        print({k: v for k, v in row.items() if k != "layer_errors"}, flush=True)
        bars = check_bars(rows, fp32_bytes)
        path.write_text(json.dumps({**meta, "rows": rows, "bars": bars}, indent=2) + "\n")

    settings = args.settings.split(",")
    for setting in settings:  # ours and RTN first: llm-compressor takes the longest
        bits, group = SETTINGS[setting]
        t0 = time.perf_counter()
        model = rtn_model(demo, bits, group)
        record({"setting": setting, "method": "RTN", "quantize_seconds": round(time.perf_counter() - t0, 1),
                "ppl": round(perplexity(model, eval_ids), 3)})
        for dtype in args.calib_dtypes.split(","):
            out = work / f"ours-{setting}-{dtype}"
            row = {"setting": setting, "method": OURS[dtype], **ours(demo, out, bits, group, samples, dtype, args.flags.split())}
            row["ppl"] = round(perplexity(load_model(str(out)).model, eval_ids), 3)
            record(row)
    if args.reuse_llmc:
        earlier = json.loads(Path(args.reuse_llmc).read_text())
        if earlier["calibration"] != meta["calibration"] or earlier["perplexity"] != meta["perplexity"]:
            raise SystemExit(f"{args.reuse_llmc} used another protocol")
        for row in earlier["rows"]:
            if row["method"] in LLMC.values() and row["setting"] in settings:
                record({**row, "reused_from": args.reuse_llmc})
    runs = [] if args.skip_llmc or args.reuse_llmc else [(s, d) for s in settings for d in args.llmc_dtypes.split(",")]
    for setting, dtype in runs:
        bits, group = SETTINGS[setting]
        out = work / f"llmc-{setting}-{dtype}"
        row = {"setting": setting, "method": LLMC[dtype], **llmc(demo, ids_file, out, bits, group, dtype)}
        try:  # its pack-quantized output, read by our compressed-tensors loader
            row["ppl"] = round(perplexity(load_model(str(out)).model, eval_ids), 3)
        except Exception as exc:  # keep the timing; say why there is no perplexity
            row["ppl"], row["error"] = float("nan"), f"{type(exc).__name__}: {exc}"[:300]
        record(row)
    print_table(rows, check_bars(rows, fp32_bytes))
    print(f"wrote {path}")


def check_bars(rows: list[dict], fp32_bytes: int) -> dict:
    """Per setting and per ours-variant: the issue's bars against llm-compressor's float32 run (its
    bf16-model run, when present, is compared as well, under `vs_llmc_bf16`)."""
    bars = {}
    by = {(r["setting"], r["method"]): r for r in rows}
    for setting in {r["setting"] for r in rows if r["setting"] != "fp32"}:
        r = by.get((setting, "RTN"))
        for dtype, label in OURS.items():
            o = by.get((setting, label))
            if not o:
                continue
            b = {"ppl_below_rtn": o["ppl"] < r["ppl"],
                 "peak_rss_within_fp32_plus_1gib": o["peak_rss_gib"] <= fp32_bytes / 2**30 + 1}
            for key, ref in (("", by.get((setting, LLMC["float32"]))), ("vs_llmc_bf16_", by.get((setting, LLMC["bfloat16"])))):
                if ref:
                    b[key + "ppl_no_worse_than_llmc"] = o["ppl"] <= ref["ppl"]
                    b[key + "time_ratio_vs_llmc"] = round(o["quantize_seconds"] / ref["quantize_seconds"], 3)
                    b[key + "time_at_most_half_of_llmc"] = b[key + "time_ratio_vs_llmc"] <= 0.5
            bars[f"{setting} {label}"] = b
    return bars


def print_table(rows: list[dict], bars: dict) -> None:
    print(f"{'setting':8} {'method':34} {'ppl':>8} {'quant s':>8} {'peak RSS GiB':>12}")
    for r in rows:
        q = r.get("quantize_seconds", "")
        m = r.get("peak_rss_gib", "")
        print(f"{r['setting']:8} {r['method']:34} {r['ppl']:8.3f} {q!s:>8} {m!s:>12}")
    print(json.dumps(bars, indent=1))


if __name__ == "__main__":
    main()
