"""A student chosen by measurement and repaired in closed form vs the evenly spaced derivation (issue #38).

    python benchmarks/reproduce/student_plan_bench.py --keep 24 --phases plan,even,train,latency --train-minutes 30 \
        --threads 2 --eval-tokens 16384

The protocol (benchmarks/common.py): the demo model (30 layers), perplexity on the first --eval-tokens
tokens of wikitext2-test.txt in 512-token windows, calibration windows of 512 tokens from enwiki-sample.txt
(--fit-windows for the repair's fit, --held-windows more for the plan's measured drift).

Phases (each writes benchmarks/results/<name>.json as soon as it is known):
- plan: the calibration walk, the plan (distill/plan.py: every candidate cut, its drift measured without
  and, for the shortlist, with the repair), the chosen cut repaired; perplexity of the teacher, the chosen
  cut unrepaired and repaired, and the plan's predicted drift beside the measured one.
- even: today's derivation (evenly spaced, first and last kept), unrepaired and repaired.
- train: each repaired student (measured, even) distilled for --train-minutes of wall clock with the
  existing loop (forward KL, temperature 1) on enwiki-sample.txt; perplexity after. Needs a quiet machine.
- latency: time per output token (greedy, median of repeats) of the teacher and each student in this one
  process. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import DATA, RESULTS, SEQ_LEN  # noqa: E402

from geminicompress.data import pack_windows, tokenize  # noqa: E402
from geminicompress.data.windows import calibration_windows, sample_windows  # noqa: E402
from geminicompress.distill.cut import cut_student  # noqa: E402
from geminicompress.distill.plan import make_plan  # noqa: E402
from geminicompress.distill.repair import RepairSpec  # noqa: E402
from geminicompress.distill.student import derive_student, keep_layers, n_params  # noqa: E402
from geminicompress.distill.survey import Compute, walk  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402

CPU = torch.device("cpu")


class Log:
    """Progress to stdout (library code never prints; scripts may)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def info(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {message}", flush=True)

    def warn(self, message: str) -> None:
        self.info(f"warning: {message}")

    def task(self, description, total):
        from contextlib import contextmanager

        log = self

        class Bar:
            done = 0

            def advance(self, n=1, **fields):
                self.done += n
                log.info(f"{description} {self.done}/{total} " + " ".join(f"{k}={v}" for k, v in fields.items()))

        @contextmanager
        def cm():
            yield Bar()

        return cm()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--keep", type=int, default=24)
    ap.add_argument("--phases", default="plan,even")
    ap.add_argument("--train-minutes", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--fit-windows", type=int, default=32)
    ap.add_argument("--held-windows", type=int, default=4)
    ap.add_argument("--shortlist", type=int, default=3)
    ap.add_argument("--repair", default="down_proj", choices=["down_proj", "linear", "none"])
    ap.add_argument("--objective", default="mse", choices=["mse", "cosine"])
    ap.add_argument("--follow", action="store_true", help="also refit the kept blocks after each cut")
    ap.add_argument("--no-follow", action="store_true", help="(the default) repair only the block before each cut")
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--teacher-ppl", type=float, default=None,
                    help="the teacher's perplexity on the same tokens from an earlier run (saves one forward; recorded as given)")
    ap.add_argument("--skip-unrepaired", action="store_true", help="do not measure the cuts without repair")
    ap.add_argument("--dropped", default=None, help="phase fixed: repair this cut (e.g. 12-17 or 3,9,14) without planning")
    ap.add_argument("--even-repair", default=None, choices=["down_proj", "linear", "none"],
                    help="the even derivation's repair (default: --repair); none is today's derivation")
    ap.add_argument("--held-data", default="enwiki", choices=["enwiki", "wikitext"],
                    help="where the plan's held-out windows come from: more enwiki windows, or WikiText-2 windows "
                         "drawn after the evaluation's tokens (the same kind of text as the evaluation, disjoint)")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of the train phase")
    ap.add_argument("--name", default="student_plan_bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = Log()
    phases = args.phases.split(",")
    out_path = RESULTS / f"{args.name}.json"
    spec = RepairSpec(args.repair, args.objective, args.ridge, follow=args.follow and not args.no_follow)
    result: dict = {"args": vars(args), "machine": machine(), "versions": versions(), "repair": asdict(spec)}

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    loaded = load_model(args.teacher)
    teacher, tok = loaded.model, loaded.tokenizer
    L = teacher.config.num_hidden_layers
    ids = tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), args.eval_tokens)
    evalw = pack_windows(ids, SEQ_LEN)
    calib = calibration_windows(tok, str(DATA / "enwiki-sample.txt"), args.fit_windows + args.held_windows, SEQ_LEN, 0)
    fitw, heldw = calib[: args.fit_windows], calib[args.fit_windows:]
    if args.held_data == "wikitext":  # disjoint from the evaluation's tokens: drawn from those after them
        rest = tokenize(tok, (DATA / "wikitext2-test.txt").read_text())[args.eval_tokens:]
        heldw = sample_windows(rest, args.held_windows, SEQ_LEN, 0)
        calib = torch.cat([fitw, heldw])

    def ppl(model) -> float:
        t0 = time.perf_counter()
        value = round(perplexity(model, evalw, CPU, batch_size=4), 4)
        log.info(f"perplexity {value} ({time.perf_counter() - t0:.0f} s)")
        return value

    result["teacher"] = {"ppl": args.teacher_ppl or ppl(teacher), "ppl_given": args.teacher_ppl is not None,
                         "params": n_params(teacher), "layers": L}
    save()
    log.info("calibration walk")
    full = walk(teacher, calib, device=CPU, progress=log)
    fit, held = full.rows(0, args.fit_windows), full.rows(args.fit_windows, len(calib))
    students: dict[str, torch.nn.Module] = {}

    def row(kept: list[int], tag: str, spec: RepairSpec = spec) -> dict:
        unrepaired = None
        if not args.skip_unrepaired:
            plain, _ = derive_student(teacher, kept)
            unrepaired = ppl(plain)
            del plain
        student, rows = cut_student(teacher, kept, fit, spec, on=Compute(progress=log))
        students[tag] = student
        repaired = ppl(student)
        t_ppl = result["teacher"]["ppl"]
        return {"kept": kept, "dropped": [i for i in range(L) if i not in kept], "params": n_params(student),
                "ppl_unrepaired": unrepaired,
                "drift_unrepaired": round(unrepaired / t_ppl - 1, 4) if unrepaired else None,
                "ppl_repaired": repaired, "drift_repaired": round(repaired / t_ppl - 1, 4), "repair_rows": rows}

    if "plan" in phases:
        t0 = time.perf_counter()
        # a view of the walk: make_plan releases the boundaries it no longer reads, and the rows below read others
        plan = make_plan(teacher, args.keep, fit.rows(0, args.fit_windows), held, heldw, spec, shortlist=args.shortlist,
                         on=Compute(progress=log))
        result["plan"] = {**plan.as_dict(), "seconds": round(time.perf_counter() - t0, 1)}
        save()
        result["measured"] = row(plan.chosen.kept, "measured")
        import math

        from geminicompress.distill.survey import mean_nll

        t_held = math.exp(mean_nll(teacher, held.hidden[-1], heldw, device=CPU))  # as cut.planned_student
        predicted = round(perplexity(students["measured"], heldw, CPU) / t_held - 1, 4)
        result["plan"]["predicted_drift"] = predicted
        measured = result["measured"]["drift_repaired"]
        result["measured"]["predicted_drift"] = predicted
        result["measured"]["prediction_error"] = round(abs(predicted - measured) / abs(measured), 4) if measured else None
        save()
    if "fixed" in phases:
        import math

        from geminicompress.distill.survey import mean_nll
        from geminicompress.eval.quality.perplexity import perplexity as held_ppl

        if "-" in args.dropped:
            lo, hi = map(int, args.dropped.split("-"))
            dropped = list(range(lo, hi + 1))
        else:
            dropped = [int(x) for x in args.dropped.split(",")]
        result["fixed"] = row([i for i in range(L) if i not in dropped], "fixed")
        t_held = math.exp(mean_nll(teacher, held.hidden[-1], heldw, device=CPU))
        predicted = held_ppl(students["fixed"], heldw, CPU) / t_held - 1
        measured = result["fixed"]["drift_repaired"]
        result["fixed"].update(predicted_drift=round(predicted, 4), held_teacher_ppl=round(t_held, 4),
                               prediction_error=round(abs(predicted - measured) / abs(measured), 4))
        save()
    if "even" in phases:
        even_spec = replace(spec, mode=args.even_repair) if args.even_repair else spec
        result["even"] = row(keep_layers(L, args.keep), "even", even_spec)
        result["even"]["repair"] = asdict(even_spec)
        save()
    if "train" in phases:
        from geminicompress.distill.train import TrainRun, train
        from geminicompress.distill.config import DistillStage

        train_text = tokenize(tok, (DATA / "enwiki-sample.txt").read_text())
        windows = pack_windows(train_text, SEQ_LEN)
        for tag, student in students.items():
            cfg = DistillStage(type="distill", train_minutes=args.train_minutes, seq_len=SEQ_LEN, batch_size=2,
                               lr=args.lr, warmup_steps=5, temperature=1.0, eval_every=10_000, eval_windows=2)
            trained, hist = train(student, teacher, windows[:-2], windows[-2:], cfg, TrainRun(0, RESULTS / f".{args.name}-{tag}", CPU, log))
            result[tag]["train"] = {"minutes": args.train_minutes, "steps": hist.step, "tokens": hist.tokens,
                                    "ppl": ppl(trained), "loss_curve": hist.loss[:: max(1, len(hist.loss) // 50)]}
            result[tag]["train"]["drift"] = round(result[tag]["train"]["ppl"] / result["teacher"]["ppl"] - 1, 4)
            save()
    if "latency" in phases:
        from geminicompress.eval.speculative import generation_speed

        prompt = evalw[:1, :128]
        result["latency"] = {"teacher_s_per_token": generation_speed(teacher, prompt, 64, repeats=5)["s_per_token"],
                             "load_average_before": list(__import__("os").getloadavg()),
                             "note": "greedy, 128-token prompt, 64 new tokens, median of 5, in this process; the "
                                     "load average says whether other jobs shared the cores (then it is noise)"}
        for tag, student in students.items():
            tpot = generation_speed(student, prompt, 64, repeats=5)["s_per_token"]
            result["latency"][f"{tag}_s_per_token"] = tpot
            result["latency"][f"{tag}_vs_teacher"] = round(tpot / result["latency"]["teacher_s_per_token"], 4)
        save()
    _table(result)


def _table(result: dict) -> None:
    t = result["teacher"]["ppl"]
    print(f"\nteacher perplexity {t}  (keep {result['args']['keep']} of {result['teacher']['layers']})")
    print(f"{'derivation':<10} {'dropped':<28} {'unrepaired':>16} {'repaired':>16} {'trained':>16} {'tpot x':>7}")
    for tag in ("measured", "fixed", "even"):
        r = result.get(tag)
        if not r:
            continue
        tr = r.get("train")
        lat = result.get("latency", {}).get(f"{tag}_vs_teacher")
        trained = f"{tr['ppl']:.2f} ({tr['drift']:+.1%})" if tr else "-"
        lat_s = f"{lat:.3f}" if lat else "-"
        plain = f"{r['ppl_unrepaired']:.2f} ({r['drift_unrepaired']:+.1%})" if r["ppl_unrepaired"] else "-"
        print(f"{tag:<10} {str(r['dropped']):<28} {plain:>16} "
              f"{r['ppl_repaired']:>8.2f} ({r['drift_repaired']:+.1%}) "
              f"{trained:>16} {lat_s:>7}")
    for tag in ("measured", "fixed"):
        if tag not in result:
            continue
        m = result[tag]
        print(f"{tag}: predicted drift {m['predicted_drift']:+.1%} vs measured {m['drift_repaired']:+.1%} "
              f"(relative error {m['prediction_error']:.1%})")


if __name__ == "__main__":
    main()
