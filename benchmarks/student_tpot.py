"""Issue #38: time per output token of students against their teacher, alternating, in one process.

`eval`'s TPOT is a median of 3 runs per model, one model after the other; two 24-layer students of the same
shape measured 0.83x and 0.95x of the teacher in two quiet `eval` runs. This one alternates the models for
--rounds rounds (so a change in the machine hits all of them), each round timing greedy generation of 1 and
of 1 + --new tokens after the same 128-token prompt (median of 3 each); TPOT = the difference / --new, so
prefill is not in it. Reports each model's median TPOT and the median of the per-round ratios.

    python benchmarks/student_tpot.py --students /tmp/s24_wt,/tmp/student24 --rounds 10 --name student24_tpot

Prints a table and writes benchmarks/results/NAME.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, RESULTS, SEQ_LEN  # noqa: E402


def tpot(model, prompt: torch.Tensor, new: int) -> float:
    from geminicompress.eval.speculative import generation_speed

    one = generation_speed(model, prompt, 1, repeats=3)["seconds"]
    many = generation_speed(model, prompt, 1 + new, repeats=3)["seconds"]
    return (many - one) / new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--students", required=True, help="comma-separated student directories")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="student_tpot")
    args = ap.parse_args()
    from geminicompress.data import pack_windows, tokenize
    from geminicompress.models.loading import load_model

    torch.set_num_threads(args.threads)
    teacher = load_model(args.teacher)
    models = {"teacher": teacher.model.eval()}
    for path in args.students.split(","):
        models[Path(path).name] = load_model(path).model.eval()
    prompt = pack_windows(tokenize(teacher.tokenizer, (DATA / "wikitext2-test.txt").read_text(), 16384), SEQ_LEN)[:1, :128]
    load = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            times[name].append(tpot(model, prompt, args.new))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    rows = {}
    for name, t in times.items():
        ratios = [s / q for s, q in zip(t, times["teacher"])]
        rows[name] = {"tpot_ms_median": round(statistics.median(t) * 1e3, 3), "tpot_ms": [round(x * 1e3, 3) for x in t],
                      "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(x, 4) for x in ratios]}
    print("\n| model | TPOT ms (median) | ratio to the teacher (median of rounds) | ratio range |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tpot_ms_median']:.1f} | {row['ratio_median']:.3f} | "
              f"{min(row['ratios']):.3f}-{max(row['ratios']):.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"teacher": args.teacher, "students": args.students.split(","), "rounds": args.rounds, "new_tokens": args.new,
         "prompt_tokens": 128, "threads": args.threads, "load_average_before": load,
         "load_average_after": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
