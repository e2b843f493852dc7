"""Issue #38: which training settings heal a cut student most in a fixed CPU budget.

One repaired student (e.g. `distill --student-layers 24 --train-minutes 0 -o S`), trained again and again
from the same start with the `distill` command for the same minutes, one setting changed per row, each run
alone (one after another, never two at once: two CPU-bound processes on 2 cores wreck throughput). Every
row is then scored on the protocol (first 16,384 WikiText-2 tokens, 512-token windows, the package's
perplexity), with the teacher and the untrained student in the same table.

    python benchmarks/studies/distill/student_train_sweep.py --student /tmp/s24 --minutes 5 \\
        --configs "default=;bf16=--precision bf16;lr1e-3=--lr 1e-3" --name student_train_sweep_5min
    python benchmarks/studies/distill/student_train_sweep.py --student /tmp/s24 --tokens 24576 \\
        --configs "fp32=--precision no;bf16=--precision bf16" --name student_train_sweep_tokens

Prints a table and writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, RESULTS, ROOT, eval_windows, perplexity  # noqa: E402


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """'name=flags;name=flags' -> [(name, argv)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        out.append((name.strip(), shlex.split(flags)))
    return out


def score(path: str, windows) -> float:
    from geminicompress.models.loading import load_model

    model = load_model(path).model.float().eval()
    return round(perplexity(model, windows), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--student", required=True, help="the repaired, untrained student directory")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=None,
                    help="train every row on this many tokens instead of --minutes (equal work, not equal time)")
    ap.add_argument("--configs", required=True, help="'name=distill flags;...' (empty flags: the defaults)")
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"), help="training text (default: the protocol's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every run (fixed, so rows compare)")
    ap.add_argument("--work", default="/tmp/student_train_sweep")
    ap.add_argument("--name", default="student_train_sweep")
    args = ap.parse_args()

    from geminicompress.models.loading import load_tokenizer

    windows = eval_windows(load_tokenizer(args.student, False))
    teacher_ppl, start_ppl = score(args.teacher, windows), score(args.student, windows)
    print(f"teacher {teacher_ppl:.2f}; untrained student {start_ppl:.2f} ({start_ppl / teacher_ppl - 1:+.1%})",
          flush=True)
    rows = []
    for name, flags in parse_configs(args.configs):
        out = Path(args.work) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "geminicompress", "distill", "--teacher", args.teacher, "--student", args.student,
               *(["--train-tokens", str(args.tokens)] if args.tokens else ["--train-minutes", str(args.minutes)]),
               "--data", args.data, "-o", str(out),
               "--force", "-q", "--threads", str(args.threads), *flags]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        stage = json.loads((out / "report.json").read_text())["stages"][0]["result"]
        ppl = score(str(out), windows)
        rows.append({"name": name, "flags": " ".join(flags), "perplexity": ppl, "drift": round(ppl / teacher_ppl - 1, 4),
                     "precision": stage.get("precision"), "steps": stage["steps"], "tokens": stage["tokens"],
                     "tokens_per_s": stage["tokens_per_s"],
                     "loss_first": stage["loss_first"], "loss_last": stage["loss_last"],
                     "held_ppl_curve": stage["ppl_curve"], "wall_s": round(wall, 1)})
        r = rows[-1]
        print(f"{name:>14}  ppl {ppl:8.2f}  drift {r['drift']:+.1%}  tokens {r['tokens']:>7}  "
              f"{r['tokens_per_s']:6.1f} tok/s  flags: {r['flags'] or '(defaults)'}", flush=True)
        write(args, teacher_ppl, start_ppl, rows)  # after every row: a stopped sweep keeps what it measured
    print("\n| setting | flags | perplexity | drift | tokens | tokens/s |\n|---|---|---|---|---|---|")
    print(f"| teacher | | {teacher_ppl:.2f} | | | |\n| untrained student | | {start_ppl:.2f} | "
          f"{start_ppl / teacher_ppl - 1:+.1%} | 0 | |")
    for r in rows:
        print(f"| {r['name']} | `{r['flags']}` | {r['perplexity']:.2f} | {r['drift']:+.1%} | {r['tokens']:,} | "
              f"{r['tokens_per_s']:.1f} |")


def write(args, teacher_ppl: float, start_ppl: float, rows: list[dict]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"teacher": args.teacher, "student": args.student, "data": args.data,
         "minutes": None if args.tokens else args.minutes, "tokens": args.tokens, "threads": args.threads,
         "teacher_ppl": teacher_ppl, "student_ppl": start_ppl, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
