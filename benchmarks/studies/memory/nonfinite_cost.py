"""What the NaN/Inf check of the input costs (issue #28's bar: within 3% of a run without it, peak memory
unchanged), two ways, side by side in one run:

1. A/B: the same command with the code before the check (`--old`, a checkout of the commit before it) and
   with this checkout, alternated (A B A B ...), each a whole process under /usr/bin/time: wall seconds and
   peak RSS, medians;
2. accounting: the command in this process with `models.finite.nonfinite` wrapped to sum the seconds spent
   in it, against the run's own total (less noisy than a difference of two wall times on a shared machine).

  python benchmarks/studies/memory/nonfinite_cost.py --old /work/wt-new --name demo \\
      --case "int8:quantize smollm2-demo --method int8" --case "prune-stream:prune smollm2-demo --stream"
  python benchmarks/studies/memory/nonfinite_cost.py --name synth8b --no-ab \\
      --case "prune-stream:prune /work/scratch/synth8b-8l --stream"

Prints a table and writes benchmarks/results/nonfinite_cost_NAME.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # the in-process accounting imports this checkout, installed or not
sys.path.insert(0, str(ROOT / "benchmarks"))  # common.py
from common import run_checkout  # noqa: E402


def timed(code: Path, args: list[str], out: Path, keep: bool = False) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `geminicompress ARGS -o OUT` run with the package at `code`; OUT is
    removed afterwards unless `keep`."""
    shutil.rmtree(out, ignore_errors=True)
    wall, rss, _ = run_checkout(code, [*args, "-o", str(out), "-q", "--threads", "2"])
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return wall, rss


def accounted(args: list[str], out: Path) -> dict:
    """Seconds spent in the check against the run's total, in this process (this checkout)."""
    import torch

    from geminicompress.models import finite

    spent = [0.0, 0]
    real = finite.nonfinite

    def counting(t, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(t, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    finite.nonfinite = counting
    torch.set_num_threads(2)
    from typer.testing import CliRunner

    from geminicompress.cli import app

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, [*args, "-o", str(out), "-q", "--threads", "2"])
    total = time.perf_counter() - t0
    finite.nonfinite = real
    shutil.rmtree(out, ignore_errors=True)
    if res.exit_code:
        raise SystemExit(res.output)
    import resource

    return {"check_seconds": round(spent[0], 3), "tensors_checked": spent[1], "run_seconds": round(total, 3),
            "share": round(spent[0] / total, 5),
            "process_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="a checkout of the code before the check (for the A/B)")
    parser.add_argument("--case", action="append", required=True, help="NAME:ARGS (without -o)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="demo")
    parser.add_argument("--no-ab", action="store_true", help="the accounting only (one run in this process); the "
                        "A/B of whole processes is left out (an 8B-shaped run takes ~16 min here)")
    args = parser.parse_args()
    if args.old is None and not args.no_ab:
        parser.error("--old is needed for the A/B (or give --no-ab)")
    work = Path(tempfile.mkdtemp(prefix="nonfinite-cost-"))
    rows = []
    for case in args.case:
        name, _, rest = case.partition(":")
        cli = shlex.split(rest)
        row: dict = {"case": name, "command": rest}
        if not args.no_ab:
            timed(ROOT, cli, work / "warm")  # warm-up (page cache, the demo's conversion)
            a, b = [], []
            for _ in range(args.repeats):
                a.append(timed(args.old, cli, work / "a"))
                b.append(timed(ROOT, cli, work / "b"))
            row.update({"old_wall_s": [round(x[0], 2) for x in a], "new_wall_s": [round(x[0], 2) for x in b],
                        "old_peak_rss": [x[1] for x in a], "new_peak_rss": [x[1] for x in b],
                        "wall_ratio_median": round(statistics.median(x[0] for x in b)
                                                   / statistics.median(x[0] for x in a), 4),
                        "rss_ratio_median": round(statistics.median(x[1] for x in b)
                                                  / statistics.median(x[1] for x in a), 4)})
            print(f"{name:14s} wall new/old {row['wall_ratio_median']:.3f}  peak RSS new/old "
                  f"{row['rss_ratio_median']:.3f}", flush=True)
        acc = accounted(cli, work / "c")
        row.update(acc)
        rows.append(row)
        print(f"{name:14s} check {acc['check_seconds']:.2f} s of {acc['run_seconds']:.1f} s "
              f"({100 * acc['share']:.2f}%, {acc['tensors_checked']} tensors), process peak RSS "
              f"{acc['process_peak_rss'] / 2**30:.2f} GiB", flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    old = None if args.no_ab else subprocess.run(["git", "-C", str(args.old), "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip()
    out = ROOT / "benchmarks" / "results" / f"nonfinite_cost_{args.name}.json"
    out.write_text(json.dumps({"commit": commit, "old_commit": old, "repeats": args.repeats, "threads": 2,
                               "rows": rows}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
