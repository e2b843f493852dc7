"""The closed-form repair fitted on real calibration windows alone, on real + teacher-sampled windows
(`repair_synthetic`, distill/synthetic.py), and on as many more real windows, side by side (issue #38).

    python benchmarks/studies/distill/repair_synthetic_bench.py --sets "13-18;6-7+13-15+21" --synthetic 96,224 --real-more 128

Every row fits the default repair (`down_proj`, ridge 0.1) of each dropped set (distill/cut.py's
`cut_student`) and scores the student on the protocol: perplexity on the first --eval-tokens WikiText-2
tokens in 512-token windows (the package's `perplexity()`). Fit windows: --real windows of 512 tokens of
enwiki-sample.txt (seed 0, as a recipe's calibration draws them), then the package's `teacher_samples` with
the recipe's default seed (0), or --real-more real windows instead. Perplexity only: no timing is claimed
(the sampling time is printed for scale).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, SEQ_LEN, calibration_ids, repair_teacher  # noqa: E402
from studies.distill.repair_sets_bench import parse_set  # noqa: E402

from geminicompress.distill.cut import cut_student  # noqa: E402
from geminicompress.distill.repair import RepairSpec  # noqa: E402
from geminicompress.distill.survey import walk  # noqa: E402
from geminicompress.distill.synthetic import prefix_len, teacher_samples  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402

CPU = torch.device("cpu")


def counts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give window counts >= 1, e.g. 96,224")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--sets", default="13-18;6-7+13-15+21")
    ap.add_argument("--real", type=int, default=32)
    ap.add_argument("--synthetic", type=counts, default=[96])
    ap.add_argument("--real-more", type=int, default=128, help="the real-window comparison (0: none)")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (a recipe's seed; default 0)")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="repair_synthetic")
    args = ap.parse_args()
    t0 = time.perf_counter()
    teacher, tok, evalw = repair_teacher(args.teacher, args.threads, args.eval_tokens)
    L = teacher.config.num_hidden_layers
    teacher_ppl = perplexity(teacher, evalw, CPU, batch_size=4)
    real = calibration_ids(tok, max(args.real, args.real_more))
    s0 = time.perf_counter()
    sampled = teacher_samples(teacher, real[: args.real], max(args.synthetic), seed=args.seed)  # the first k: what k gives
    sample_s = time.perf_counter() - s0
    print(f"[{time.perf_counter() - t0:.0f}s] teacher {teacher_ppl:.3f}; {sampled.shape[0]} windows sampled in "
          f"{sample_s:.0f} s", flush=True)
    fits = {f"{args.real} real": real[: args.real]}
    fits.update({f"{args.real} real + {k} sampled": torch.cat([real[: args.real], sampled[:k]]) for k in args.synthetic})
    if args.real_more:
        fits[f"{args.real_more} real"] = real[: args.real_more]
    result = {"args": vars(args), "machine": machine(), "versions": versions(), "teacher_ppl": round(teacher_ppl, 4),
              "prefix": prefix_len(SEQ_LEN), "sampled_windows": int(sampled.shape[0]),
              "sampling_seconds": round(sample_s, 1), "rows": []}
    for label, windows in fits.items():
        fit = walk(teacher, windows, device=CPU)
        for text in args.sets.split(";"):
            dropped = parse_set(text)
            student, _ = cut_student(teacher, [i for i in range(L) if i not in dropped], fit, RepairSpec(ridge=args.ridge))
            ppl = perplexity(student, evalw, CPU, batch_size=4)
            result["rows"].append({"fit": label, "fit_windows": int(windows.shape[0]), "dropped": text,
                                   "ppl": round(ppl, 4), "drift": round(ppl / teacher_ppl - 1, 4)})
            print(f"[{time.perf_counter() - t0:.0f}s] {label:>22}  {text:>14}: {ppl:.3f} ({ppl / teacher_ppl - 1:+.1%})",
                  flush=True)
            (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
            del student
        del fit
        gc.collect()
    print(f"\n| fit windows | {' | '.join(args.sets.split(';'))} |\n|---|{'---|' * len(args.sets.split(';'))}")
    for label in fits:
        cells = [f"{r['ppl']:.2f} ({r['drift']:+.1%})" for r in result["rows"] if r["fit"] == label]
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
