"""distill's training throughput and whole-process peak, this checkout against an older one, side by side.

Runs the same `geminicompress distill` command with each checkout on PYTHONPATH (`--old DIR`: e.g. `git worktree
add /tmp/old 1162c85`, the commit before the chunked head), old then new, `--rounds` times, one process at a time
under `/usr/bin/time -v`; reads each run's report.json (steps, tokens, training seconds, tokens/s, the first
losses) and the peak resident set. Prints a table and writes the JSON.

    python benchmarks/reproduce/distill_old_new.py --old /tmp/old --work /tmp/tok --rounds 2 \
        --name distill_gemma_old_new -- --teacher /work/models/gemma3-270m --student-layers 14 --derive even \
        --repair none --steps 4 --data ../shared/data/enwiki-sample.txt
`--collect` reads runs already made in WORK (old1, new1, old2, ...) instead of running them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, peak_rss, run_checkout  # noqa: E402

NEW = Path(__file__).resolve().parents[2]


def run_one(checkout: Path, out: Path, args: list[str]) -> None:
    run_checkout(checkout, ["distill", *args, "-o", str(out), "--force", "--quiet"], Path(f"{out}.log"))


def collect(out: Path) -> dict:
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    peak = peak_rss(Path(f"{out}.log").read_text())
    return {"run": out.name, "steps": result["steps"], "tokens": result["tokens"],
            "train_seconds": result["train_seconds"], "tokens_per_s": result["tokens_per_s"],
            "loss_first": [round(x, 6) for x in result["loss_curve"][:4]], "peak_gib": round(peak / 2**30, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the older checkout (its folder holds geminicompress/)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--collect", action="store_true", help="read the runs already in WORK")
    ap.add_argument("--name", required=True)
    ap.add_argument("distill_args", nargs=argparse.REMAINDER, help="-- then distill's arguments (no -o)")
    a = ap.parse_args()
    work, args = Path(a.work), [x for x in a.distill_args if x != "--"]
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(1, a.rounds + 1):
        for who, checkout in (("old", Path(a.old)), ("new", NEW)):
            out = work / f"{who}{r}"
            if not a.collect:
                run_one(checkout, out, args)
            rows.append({"who": who, **collect(out)})
            print(f"{who}{r}: {rows[-1]['tokens_per_s']:.1f} tokens/s, peak {rows[-1]['peak_gib']:.2f} GiB, "
                  f"losses {rows[-1]['loss_first']}", flush=True)
    med = {w: statistics.median(x["tokens_per_s"] for x in rows if x["who"] == w) for w in ("old", "new")}
    peak = {w: max(x["peak_gib"] for x in rows if x["who"] == w) for w in ("old", "new")}
    print(f"tokens/s median: old {med['old']:.1f}, new {med['new']:.1f} ({med['new'] / med['old']:.2f}x); "
          f"peak: old {peak['old']:.2f} GiB, new {peak['new']:.2f} GiB")
    out = {"benchmark": "distill training throughput and whole-process peak, this checkout against an older one",
           "command": "python " + " ".join(sys.argv), "old": a.old, "distill_args": args, "runs": rows,
           "median_tokens_per_s": med, "peak_gib": peak, "ratio_new_old": round(med["new"] / med["old"], 3)}
    path = RESULTS / f"{a.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
