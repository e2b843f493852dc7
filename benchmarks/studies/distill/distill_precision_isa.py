"""`precision: auto`'s rule, measured: bf16 trains faster only where the CPU multiplies bf16 natively.

The same short `distill` run (one repaired student, `--train-tokens N`, 2 threads) in float32 and in bf16, on
this CPU as it is and with oneDNN and ATen held to instruction sets without bf16 (ONEDNN_MAX_CPU_ISA,
ATEN_CPU_CAPABILITY: what a CPU without AVX-512 BF16 would run). Runs one after another, never two at once.

    python benchmarks/studies/distill/distill_precision_isa.py --student /tmp/s24 --tokens 8192

Prints a table and writes benchmarks/results/distill_precision_isa.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, RESULTS, ROOT  # noqa: E402

ISAS = {  # name -> environment
    "native": {},
    "avx512 without bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def run(student: str, tokens: int, precision: str, env: dict[str, str], out: Path, data: str) -> dict:
    cmd = [sys.executable, "-m", "geminicompress", "distill", "--teacher", "smollm2-demo", "--student", student,
           "--train-tokens", str(tokens), "--precision", precision, "--data", data, "-o", str(out), "--force", "-q",
           "--threads", "2"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **env})
    stage = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    return {"tokens": stage["tokens"], "train_seconds": stage["train_seconds"], "tokens_per_s": stage["tokens_per_s"],
            "loss_last": stage["loss_last"], "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--student", required=True, help="a repaired student directory (distill --train-minutes 0)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"))
    ap.add_argument("--work", default="/tmp/distill_precision_isa")
    args = ap.parse_args()
    rows = []
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for isa, env in ISAS.items():
        for precision in ("no", "bf16"):
            r = run(args.student, args.tokens, precision, env, Path(args.work) / f"{len(rows)}", args.data)
            rows.append({"isa": isa, "env": env, "precision": precision, **r})
            print(f"{isa:>20}  {precision:>4}  {r['tokens_per_s']:7.1f} tokens/s  loss {r['loss_last']:.4f}",
                  flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_precision_isa.json").write_text(json.dumps(
        {"student": args.student, "tokens": args.tokens, "threads": 2, "rows": rows}, indent=1))
    print("\n| instructions | float32 tokens/s | bf16 tokens/s | bf16 / float32 |\n|---|---|---|---|")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        print(f"| {a['isa']} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
              f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
