"""Greedy block removal by measured repaired drift, then the protocol's perplexity (issue #38).

    python benchmarks/studies/distill/repair_greedy_bench.py --keep 24 --held-data wikitext --held-windows 4 --threads 1

The demo's calibration walk (--fit-windows x 512 tokens of enwiki-sample.txt, seed 0) fits each repair;
the held-out windows the search is judged on are --held-windows x 512 tokens of WikiText-2 drawn after the
protocol's first --eval-tokens tokens (disjoint from them), or more enwiki windows. distill/greedy.py removes
one block at a time (the one whose repaired removal costs the least held-out drift) until --keep remain.
The set found is then cut and repaired (cut_student, the package's repair) and scored on the protocol
(perplexity of the first --eval-tokens WikiText-2 tokens in 512-token windows; teacher 28.82).
Writes benchmarks/results/<name>.json after every step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import DATA, RESULTS, SEQ_LEN, calibration_ids, repair_teacher  # noqa: E402

from geminicompress.data import tokenize  # noqa: E402
from geminicompress.data.windows import sample_windows  # noqa: E402
from geminicompress.distill.cut import cut_student  # noqa: E402
from geminicompress.distill.greedy import greedy_cut  # noqa: E402
from geminicompress.distill.repair import RepairSpec  # noqa: E402
from geminicompress.distill.survey import Compute, walk  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402

CPU = torch.device("cpu")


class _Log:
    """Progress that prints each finished task's description (the bench's log)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0

    def task(self, description, total):
        from contextlib import nullcontext

        print(f"[{time.perf_counter() - self.t0:.0f}s] {description}", flush=True)
        t0 = self.t0

        def advance(n=1, **fields):
            if fields:
                print(f"[{time.perf_counter() - t0:.0f}s]   " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

        return nullcontext(type("T", (), {"advance": staticmethod(advance)})())

    def info(self, message):
        print(message, flush=True)

    warn = info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--keep", type=int, default=24)
    ap.add_argument("--fit-windows", type=int, default=32)
    ap.add_argument("--held-windows", type=int, default=4)
    ap.add_argument("--held-data", default="wikitext", choices=["wikitext", "enwiki"])
    ap.add_argument("--pool", type=int, default=None, help="candidates per step after the first (default all)")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--weighting", default="uniform", choices=["uniform", "skip_first", "inverse_norm"])
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--teacher-ppl", type=float, default=28.82)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="repair_greedy_24")
    args = ap.parse_args()
    t0 = time.perf_counter()
    teacher, tok, evalw = repair_teacher(args.teacher, args.threads, args.eval_tokens)
    L = teacher.config.num_hidden_layers
    text = (DATA / "wikitext2-test.txt").read_text()
    calib = calibration_ids(tok, args.fit_windows + args.held_windows)
    fitw, heldw = calib[: args.fit_windows], calib[args.fit_windows:]
    if args.held_data == "wikitext":  # disjoint from the evaluation's tokens: drawn from those after them
        heldw = sample_windows(tokenize(tok, text)[args.eval_tokens:], args.held_windows, SEQ_LEN, 0)
    full = walk(teacher, torch.cat([fitw, heldw]), device=CPU)
    fit, held = full.rows(0, args.fit_windows), full.rows(args.fit_windows, args.fit_windows + args.held_windows)
    spec = RepairSpec("down_proj", ridge=args.ridge, weighting=args.weighting)
    result = {"args": vars(args), "machine": machine(), "versions": versions(), "teacher_ppl_given": args.teacher_ppl}
    out = RESULTS / f"{args.name}.json"
    steps = greedy_cut(teacher, args.keep, fit, held, heldw, spec, pool=args.pool, on=Compute(progress=_Log(t0)))
    result["steps"] = [asdict(s) for s in steps]
    for s in steps:
        best5 = sorted(s.tried.items(), key=lambda kv: kv[1])[:5]
        print(f"drop {s.block:2d} -> {s.dropped}: held drift {s.drift:+.1%}; best tried "
              + ", ".join(f"{b}: {d:+.1%}" for b, d in best5), flush=True)
    out.write_text(json.dumps(result, indent=1))
    dropped = steps[-1].dropped
    kept = [i for i in range(L) if i not in dropped]
    student, rows = cut_student(teacher, kept, fit, spec)
    ppl = perplexity(student, evalw, CPU, batch_size=4)
    result.update(dropped=dropped, ppl=round(ppl, 4), drift=round(ppl / args.teacher_ppl - 1, 4), repair_rows=rows,
                  seconds=round(time.perf_counter() - t0))
    print(f"[{time.perf_counter() - t0:.0f}s] greedy {dropped}: ppl {ppl:.3f} drift {ppl / args.teacher_ppl - 1:+.1%}",
          flush=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
