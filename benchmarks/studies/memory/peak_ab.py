"""Peak memory and wall time of the same command with two checkouts of the package, side by side in one run.

Each case runs as a whole process under /usr/bin/time (`python -m geminicompress ARGS -o OUT -q --threads 2`,
the package imported from the checkout named), this checkout and `--old` alternated (A B A B ...), and the
medians are compared. Outputs are compared too: every safetensors tensor of A's OUT must equal B's bit for
bit (a change that saves memory must not change what is written), else the script stops.

  python benchmarks/studies/memory/peak_ab.py --old /path/to/checkout-before --name gptq_inmemory_trim \\
      --case "gptq:quantize smollm2-demo --method gptq --bits 4 --group-size 64 --samples 32 \\
              --calib-seq-len 512 --data ../shared/data/enwiki-sample.txt"

Prints a table and writes benchmarks/results/peak_ab_NAME.json. Run it alone: on 2 cores a second process
distorts the wall times (the peaks do not move with load).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from studies.memory.nonfinite_cost import timed  # noqa: E402  (one way to time a whole command, shared)


def tensors(out: Path) -> dict:
    from safetensors.torch import load_file

    found: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return found


def same_tensors(a: Path, b: Path) -> bool:
    """Every safetensors tensor of A equal to B's, bit for bit (NaN-safe: compared as bytes)."""
    import torch

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
        and torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)) for k in ta)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the code to compare with (B)")
    parser.add_argument("--case", action="append", required=True, help="NAME:ARGS (without -o)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    commit = {c: subprocess.run(["git", "-C", str(c), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() for c in (ROOT, args.old)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.case:
            name, _, cmd = case.partition(":")
            argv = shlex.split(cmd)
            runs: dict[str, list[tuple[float, int]]] = {"new": [], "old": []}
            for r in range(args.repeats):
                for label, code in (("new", ROOT), ("old", args.old)):
                    out = Path(tmp) / f"{name}-{label}"
                    runs[label].append(timed(code, argv, out, keep=r == args.repeats - 1))
            if not same_tensors(Path(tmp) / f"{name}-new", Path(tmp) / f"{name}-old"):
                raise SystemExit(f"{name}: the two checkouts write different tensors")
            med = {k: (statistics.median(w for w, _ in v), statistics.median(p for _, p in v)) for k, v in runs.items()}
            rows.append({"case": name, "args": argv, "same_tensors": True,
                         "runs": {k: [{"wall_s": round(w, 2), "peak_rss_kib": p // 1024} for w, p in v]
                                  for k, v in runs.items()},
                         "median": {k: {"wall_s": round(w, 2), "peak_rss_kib": p // 1024} for k, (w, p) in med.items()},
                         "peak_ratio": round(med["new"][1] / med["old"][1], 4),
                         "wall_ratio": round(med["new"][0] / med["old"][0], 4)})
    print(f"| case | peak new (GiB) | peak old (GiB) | ratio | wall new (s) | wall old (s) | ratio |   "
          f"(new {commit[ROOT]}, old {commit[args.old]}, {args.repeats} runs each, medians)")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n, o = r["median"]["new"], r["median"]["old"]
        print(f"| {r['case']} | {n['peak_rss_kib'] / 2**20:.2f} | {o['peak_rss_kib'] / 2**20:.2f} | {r['peak_ratio']:.3f} "
              f"| {n['wall_s']:.1f} | {o['wall_s']:.1f} | {r['wall_ratio']:.3f} |")
    path = ROOT / "benchmarks" / "results" / f"peak_ab_{args.name}.json"
    path.write_text(json.dumps({"new": commit[ROOT], "old": commit[args.old], "repeats": args.repeats,
                                "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
