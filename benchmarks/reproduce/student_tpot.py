"""Issue #38: time per output token of students against their teacher, alternating, in one process.

`eval`'s TPOT is a median of 3 runs per model, one model after the other; two 24-layer students of the same
shape measured 0.83x and 0.95x of the teacher in two quiet `eval` runs. This one alternates the models for
--rounds rounds (so a change in the machine hits all of them), each round starting with the next model in
turn (so no model always runs right after another). Each round times, per model, 3 greedy runs of
1 + --new tokens after the same 128-token prompt with `eval`'s own decode loop
(`geminicompress.eval.cost.latency.greedy_run`: the model's forward with the KV cache and an argmax, prefill
excluded), and takes the median; TPOT = decode time / --new. Reports each model's median TPOT and the median
of the per-round ratios to the teacher.

`--control 13-18` adds the teacher with those layers removed (a checkpoint holding the others, exactly,
written and loaded like a student): the student's
shape with the teacher's weights, on the same code path. It is the floor a student of that shape can reach: a
student slower than its control carries some overhead of its own.

(Until 2026-12-04 this script timed `model.generate`, whose per-token bookkeeping does not shrink with the
layers: 0.88-0.91x in the results of that date. `eval` never measured with `generate`.)

    python benchmarks/reproduce/student_tpot.py --students /tmp/s24 --control 13-18 --rounds 12 --name student24_tpot_loop

Prints a table and writes benchmarks/results/NAME.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, RESULTS, SEQ_LEN  # noqa: E402


def layer_span(text: str) -> tuple[int, int]:
    """ "13-18" -> (13, 18): the first and last layer to remove, inclusive; anything else is refused in one line."""
    try:
        first, last = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a layer span FIRST-LAST, e.g. 13-18") from None
    if not 0 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= FIRST <= LAST")
    return first, last


def without_layers(teacher, span: tuple[int, int], out: Path):
    """A checkpoint in `out` of the teacher's architecture without the layers `span` (first, last inclusive): the
    kept layers, embedding, norm and head copied exactly (`distill.student.derive_student`, the even derivation's
    builder), written and loaded back like any student, so that its tensors sit in memory as a loaded model's do."""
    from geminicompress.distill.student import derive_student
    from geminicompress.models.loading import load_model

    first, last = span
    n = teacher.model.config.num_hidden_layers
    if last >= n or last - first + 1 >= n:
        raise SystemExit(f"--control {first}-{last}: the teacher has layers 0-{n - 1}, and at least one must stay")
    derive_student(teacher.model, [i for i in range(n) if not first <= i <= last])[0].save_pretrained(out)
    teacher.tokenizer.save_pretrained(out)
    return load_model(str(out)).model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--students", default="", help="comma-separated student directories")
    ap.add_argument("--control", type=layer_span, default=None,
                    help="layers to remove from the teacher for a same-shape control, e.g. 13-18")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="student_tpot")
    args = ap.parse_args()
    from geminicompress.data import pack_windows, tokenize
    from geminicompress.eval.cost.latency import median_tpot
    from geminicompress.models.loading import load_model

    torch.set_num_threads(args.threads)
    teacher = load_model(args.teacher)
    models = {"teacher": teacher.model.eval()}
    control = "{}-{}".format(*args.control) if args.control else ""
    if control:
        scratch = tempfile.TemporaryDirectory(prefix="control-")  # held until the end: the control is read from it
        models[f"teacher without {control}"] = without_layers(teacher, args.control, Path(scratch.name))
    for path in filter(None, args.students.split(",")):
        models[Path(path).name] = load_model(path).model.eval()
    prompt = pack_windows(tokenize(teacher.tokenizer, (DATA / "wikitext2-test.txt").read_text(), 16384), SEQ_LEN)[:1, :128]
    cpu = torch.device("cpu")
    for model in models.values():  # warm-up: first calls allocate
        median_tpot(model, prompt, 1 + args.new, cpu, repeats=1)
    load = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        names = list(models)
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts with the next model
            times[name].append(median_tpot(models[name], prompt, 1 + args.new, cpu))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    rows = {}
    for name, t in times.items():
        ratios = [s / q for s, q in zip(t, times["teacher"])]
        rows[name] = {"tpot_ms_median": round(statistics.median(t) * 1e3, 3), "tpot_ms": [round(x * 1e3, 3) for x in t],
                      "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(x, 4) for x in ratios],
                      "layers": models[name].config.num_hidden_layers}
    print("\n| model | layers | TPOT ms (median) | ratio to the teacher (median of rounds) | ratio range |\n|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['layers']} | {row['tpot_ms_median']:.1f} | {row['ratio_median']:.3f} | "
              f"{min(row['ratios']):.3f}-{max(row['ratios']):.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"teacher": args.teacher, "students": list(filter(None, args.students.split(","))), "control": control,
         "timed_with": "geminicompress.eval.cost.latency.greedy_run", "rounds": args.rounds, "new_tokens": args.new,
         "prompt_tokens": 128, "threads": args.threads, "load_average_before": load,
         "load_average_after": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
