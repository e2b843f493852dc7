"""Depth cuts of the same size repaired alike, compared on the protocol (issue #38): contiguous spans vs
sets of shorter runs, each run repaired at the block before it (distill/cut.py's `cut_student`).

    python benchmarks/studies/distill/repair_sets_bench.py --sets "13-18;12-14+16-18;13-15+17-19" --ridge 0.1 --threads 1

Perplexity on the protocol's WikiText-2 windows (first --eval-tokens tokens, 512-token windows, the
package's `perplexity()`); the repair fits on --fit-windows x 512 enwiki-sample.txt windows (seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, calibration_ids, repair_teacher  # noqa: E402

from geminicompress.distill.cut import cut_student  # noqa: E402
from geminicompress.distill.repair import RepairSpec  # noqa: E402
from geminicompress.distill.survey import walk  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402

CPU = torch.device("cpu")


def parse_set(text: str) -> list[int]:
    """'12-14+16-18' -> [12, 13, 14, 16, 17, 18]; '3,9,14' -> [3, 9, 14]."""
    out: list[int] = []
    for part in text.replace(",", "+").split("+"):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--sets", default="13-18")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--repair", default="down_proj", choices=["down_proj", "linear", "none"])
    ap.add_argument("--fit-windows", type=int, default=32)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--teacher-ppl", type=float, default=28.82)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="repair_sets")
    args = ap.parse_args()
    t0 = time.perf_counter()
    teacher, tok, evalw = repair_teacher(args.teacher, args.threads, args.eval_tokens)
    L = teacher.config.num_hidden_layers
    fitw = calibration_ids(tok, args.fit_windows)
    fit = walk(teacher, fitw, device=CPU)
    spec = RepairSpec(args.repair, ridge=args.ridge)
    result = {"args": vars(args), "machine": machine(), "versions": versions(), "teacher_ppl_given": args.teacher_ppl,
              "sets": {}}
    for text in args.sets.split(";"):
        dropped = parse_set(text)
        kept = [i for i in range(L) if i not in dropped]
        student, rows = cut_student(teacher, kept, fit, spec)
        ppl = perplexity(student, evalw, CPU, batch_size=4)
        result["sets"][text] = {"dropped": dropped, "ppl": round(ppl, 4), "drift": round(ppl / args.teacher_ppl - 1, 4),
                                "repair_rows": rows}
        print(f"[{time.perf_counter() - t0:.0f}s] {text}: ppl {ppl:.3f} drift {ppl / args.teacher_ppl - 1:+.1%}",
              flush=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        del student


if __name__ == "__main__":
    main()
