"""What the check of OUT (geminicompress/engine/verify.py) costs: the same command with and without `--no-verify`,
alternating (A B A B ...), each a whole process under /usr/bin/time -v; medians per side and their
difference. Time only inside a quiet window (/work/logs/quiet.sh): the result records the load average.

  /work/logs/quiet.sh python benchmarks/studies/stream/verify_time.py --work /tmp/vt --runs 2 \\
      --case "int8:quantize --method int8" --case "int8-stream:quantize --method int8 --stream"

MODEL defaults to the demo model's converted directory. Writes benchmarks/results/verify_time[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reproduce.stream_time import ROOT, demo_dir, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local safetensors directory (default: the demo model's)")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--case", action="append", required=True, help="NAME:COMMAND ARGS")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    model = a.model or demo_dir()
    a.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for spec in a.case:
        name, _, args = spec.partition(":")
        command, *rest = shlex.split(args)
        sides: dict[str, list[tuple[float, int]]] = {"verify": [], "no-verify": []}
        for k in range(a.runs):
            for side in sides:
                out = a.work / f"{name}-{side}"
                flag = ["--no-verify"] if side == "no-verify" else []
                cmd = [sys.executable, "-m", "geminicompress", command, model, "-o", str(out), "--force", "-q", *rest,
                       *flag]
                log = a.work / f"{name}-{side}-{k}.log"
                rc, wall, rss = timed(cmd, log)
                if rc != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); see {log}")
                if side == "verify":
                    verified = json.loads((out / "report.json").read_text())["export"]["verified"]
                sides[side].append((wall, rss))
                shutil.rmtree(out, ignore_errors=True)
        v = statistics.median(w for w, _ in sides["verify"])
        n = statistics.median(w for w, _ in sides["no-verify"])
        rows.append({"case": name, "command": args, "runs": a.runs, "verify_wall_s": round(v, 3),
                     "no_verify_wall_s": round(n, 3), "check_s": round(v - n, 3),
                     "verify_walls": [round(w, 3) for w, _ in sides["verify"]],
                     "no_verify_walls": [round(w, 3) for w, _ in sides["no-verify"]],
                     "verify_peak_mib": max(r for _, r in sides["verify"]) >> 20,
                     "no_verify_peak_mib": max(r for _, r in sides["no-verify"]) >> 20, "verified": verified})
    load_after = os.getloadavg()
    print(f"{'case':<14} {'runs':>4} {'verify s':>9} {'--no-verify s':>14} {'check s':>8} {'peak MiB v/n':>14}")
    for r in rows:
        print(f"{r['case']:<14} {r['runs']:>4} {r['verify_wall_s']:>9.2f} {r['no_verify_wall_s']:>14.2f} "
              f"{r['check_s']:>8.2f} {r['verify_peak_mib']:>6}/{r['no_verify_peak_mib']}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    from geminicompress.host.machine import machine, versions

    result = {"model": model, "rows": rows, "load_before": load_before, "load_after": load_after,
              "machine": machine(), "versions": versions()}
    path = ROOT / "benchmarks" / "results" / f"verify_time{'_' + a.name if a.name else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
