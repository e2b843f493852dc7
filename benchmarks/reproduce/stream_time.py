"""Time bar of issue 15: the streamed path costs at most 1.15x the in-memory path on the demo model.

For each case, the same command with `--stream` and with `--no-stream`, alternating (A B A B ...), each
a whole process under /usr/bin/time -v (wall time and peak RSS); medians per side and their ratio.
Time only on a quiet machine (two CPU-bound processes on 2 cores wreck timings): the table records the
load average before and after.

  python benchmarks/reproduce/stream_time.py --work /tmp/st --runs 3 \\
      --case "prune:prune --sparsity 0.4" --case "int8:quantize --method int8"

MODEL defaults to the demo model's converted directory. Writes benchmarks/results/stream_time[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def timed(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """(exit code, wall seconds, peak RSS bytes) of one whole process."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())
    return rc, wall, int(m.group(1)) * 1024 if m else -1


def demo_dir() -> str:
    from geminicompress.models.loading import demo_dir

    return str(demo_dir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local safetensors directory (default: the demo model's)")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--case", action="append", required=True, help="NAME:COMMAND ARGS, e.g. prune:'prune --sparsity 0.4'")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    model = a.model or demo_dir()
    a.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for spec in a.case:
        name, _, args = spec.partition(":")
        command, *rest = shlex.split(args)
        sides: dict[str, list[tuple[float, int]]] = {"stream": [], "no-stream": []}
        for k in range(a.runs):
            for side in sides:
                out = a.work / f"{name}-{side}"
                cmd = [sys.executable, "-m", "geminicompress", command, model, "-o", str(out), f"--{side}", "--force",
                       "-q", *rest]
                rc, wall, rss = timed(cmd, a.work / f"{name}-{side}-{k}.log")
                if rc != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); see {a.work / f'{name}-{side}-{k}.log'}")
                sides[side].append((wall, rss))
                shutil.rmtree(out, ignore_errors=True)
        s = statistics.median(w for w, _ in sides["stream"])
        m = statistics.median(w for w, _ in sides["no-stream"])
        rows.append({"case": name, "command": args, "runs": a.runs, "stream_wall_s": round(s, 3),
                     "in_memory_wall_s": round(m, 3), "ratio": round(s / m, 3),
                     "stream_walls": [round(w, 3) for w, _ in sides["stream"]],
                     "in_memory_walls": [round(w, 3) for w, _ in sides["no-stream"]],
                     "stream_peak_mib": max(r for _, r in sides["stream"]) >> 20,
                     "in_memory_peak_mib": max(r for _, r in sides["no-stream"]) >> 20})
    load_after = os.getloadavg()
    print(f"{'case':<12} {'runs':>4} {'streamed s':>11} {'in-memory s':>12} {'ratio':>6} {'peak MiB s/m':>14}")
    for r in rows:
        print(f"{r['case']:<12} {r['runs']:>4} {r['stream_wall_s']:>11.2f} {r['in_memory_wall_s']:>12.2f} "
              f"{r['ratio']:>5.2f}x {r['stream_peak_mib']:>6}/{r['in_memory_peak_mib']}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    from geminicompress.host.machine import machine, versions

    result = {"model": model, "rows": rows, "load_before": load_before, "load_after": load_after,
              "machine": machine(), "versions": versions()}
    path = ROOT / "benchmarks" / "results" / f"stream_time{'_' + a.name if a.name else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
