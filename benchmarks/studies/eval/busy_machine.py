"""Timings on a busy machine: the quickstart-style eval, quiet vs beside CPU-bound processes (issue #16).

For each condition it runs `geminicompress eval` (or the whole `geminicompress run quickstart`) in a
fresh process, reads the report and the warning lines, and prints one table row:

    quiet    x threads 1, 2, auto
    busy     x threads 1, 2, auto      (busy = N background processes spinning `while True: pass`)

The bar: busy + auto/2 threads prints "timings unreliable"; busy + --threads 1 gives a TPOT within 20%
of the quiet run's. Run it on an otherwise quiet machine (it is meaningless on a shared one):

    python benchmarks/studies/eval/busy_machine.py                        # eval smollm2-demo, latency only (~2 min a row)
    python benchmarks/studies/eval/busy_machine.py --quickstart           # the full quickstart recipe per row (slower)
    python benchmarks/studies/eval/busy_machine.py --model out-quickstart # also time that model beside the baseline

Writes benchmarks/results/busy_machine.json (busy_machine_quickstart.json with --quickstart).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
QUICK = ["--data", "builtin:pydoc", "--max-tokens", "8192", "--seq-len", "512", "--prompt-len", "128",
         "--gen-len", "32", "--batch-sizes", "1,4", "--repeats", "3"]


# CPU-bound until its parent goes away (so that a killed benchmark leaves no spinner behind)
SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(10**6): pass\n"


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def one_run(args, threads: str, folder: Path) -> dict:
    out = folder / f"out-{threads}-{time.monotonic_ns()}"
    thread_flag = [] if threads == "auto" else ["--threads", threads]
    if args.quickstart:
        cmd = [sys.executable, "-m", "geminicompress", "run", "quickstart", "-o", str(out), *thread_flag]
        report_file = out / "eval" / "report.json"
    else:
        quality = [] if args.with_quality else ["--no-quality"]
        cmd = [sys.executable, "-m", "geminicompress", "eval", "smollm2-demo", *([args.model] if args.model else []),
               *QUICK, *quality, "-o", str(out), *thread_flag]
        report_file = out / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": round(wall, 1)}
    report = json.loads(report_file.read_text())
    models = []
    for m in report["models"]:
        lat = m.get("latency") or {}
        load = lat.get("load") or {}
        models.append({"name": m["name"], "ttft_ms": (lat.get("ttft_ms") or {}).get("median"),
                       "tpot_ms": (lat.get("tpot_ms") or {}).get("median"),
                       "tpot_p90_ms": (lat.get("tpot_ms") or {}).get("p90"),
                       "other_cores": load.get("other_cores"), "unreliable": load.get("unreliable")})
    warned = [line for line in proc.stderr.splitlines() if "timings unreliable" in line]
    return {"wall_s": round(wall, 1), "threads_used": report["machine"]["torch_threads"], "models": models,
            "warning": warned[0] if warned else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quickstart", action="store_true", help="run the whole quickstart recipe per condition")
    ap.add_argument("--model", help="a compressed model to time beside smollm2-demo (eval mode)")
    ap.add_argument("--with-quality", action="store_true", help="also measure perplexity (eval mode)")
    ap.add_argument("--spinners", type=int, default=1, help="background CPU-bound processes when busy")
    ap.add_argument("--threads", default="1,2,auto", help="thread settings to try")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally` that stops the spinners

    import torch

    from geminicompress.host.machine import machine, versions

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (False, True):
            for threads in args.threads.split(","):
                procs = spinners(args.spinners) if busy else []
                try:
                    time.sleep(2.0 if busy else 0.0)  # let the spinners show up in the load sample
                    result = one_run(args, threads, Path(tmp))
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                row = {"busy": busy, "threads": threads, **result}
                rows.append(row)
                print(json.dumps(row), flush=True)
                time.sleep(5.0)  # let the load settle before the next condition

    quiet = {r["threads"]: r for r in rows if not r["busy"] and "models" in r}
    best_quiet = min((r["models"][0]["tpot_ms"] for r in quiet.values() if r["models"][0]["tpot_ms"]), default=None)
    print(f"\n{'condition':<14} {'threads':>7} {'used':>4} {'TPOT ms':>8} {'p90':>7} {'vs quiet':>8} "
          f"{'others':>6}  warning")
    for r in rows:
        if "models" not in r:
            print(f"{'busy' if r['busy'] else 'quiet':<14} {r['threads']:>7}  failed: {r['error']}")
            continue
        m = r["models"][0]
        ratio = f"{m['tpot_ms'] / best_quiet:.2f}x" if best_quiet and m["tpot_ms"] else "n/a"
        print(f"{'busy' if r['busy'] else 'quiet':<14} {r['threads']:>7} {r['threads_used']:>4} "
              f"{m['tpot_ms'] or 0:>8.1f} {m['tpot_p90_ms'] or 0:>7.1f} {ratio:>8} {m['other_cores'] or 0:>6.2f}  "
              f"{'yes' if r['warning'] else 'no'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"command": sys.argv, "spinners": args.spinners, "mode": "quickstart" if args.quickstart else "eval",
           "machine": machine(), "versions": versions(), "torch_default_threads": torch.get_num_threads(),
           "rows": rows}
    path = RESULTS / ("busy_machine_quickstart.json" if args.quickstart else "busy_machine.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
