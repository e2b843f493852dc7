"""Issue #38: do hidden-state losses heal a cut student better in a fixed CPU budget?

Like `student_train_sweep.py` (one repaired student trained again and again from the same start for the same
minutes, each run alone, every row scored on the protocol), but each row is a recipe (`geminicompress run`),
so it can set what the `distill` command cannot: `layer_map` for a student loaded from a directory. The
layer map is the one a derived student gets by default (`distill/student.boundary_mapped`: student layer j
-> teacher layer kept[j + 1] - 1), from the layers the start dropped.

    python benchmarks/studies/distill/student_loss_sweep.py --student /work/runs/s24_rep0 --dropped 13-18 --minutes 4 \\
        --configs '{"base": {}, "cos": {"loss": {"hidden_cos": 1.0}}, "mse10": {"loss": {"hidden_mse": 10.0}}}' \\
        --name student_loss_sweep_4min

Each config is a dict of distill-stage keys (`loss` merged into the default weights). Prints a table and
writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, RESULTS, ROOT, eval_windows, parse_layers, perplexity  # noqa: E402
from studies.distill.student_train_sweep import score  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--student", required=True, help="the repaired, untrained student directory")
    ap.add_argument("--dropped", required=True, help="teacher layers the student dropped, e.g. 13-18")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--configs", required=True, help='JSON {"name": {distill stage keys}}')
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"), help="training text (default: the protocol's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=tempfile.gettempdir() + "/student_loss_sweep")
    ap.add_argument("--name", default="student_loss_sweep")
    args = ap.parse_args()

    from geminicompress.distill.student import boundary_mapped
    from geminicompress.models.loading import load_model, load_tokenizer

    windows = eval_windows(load_tokenizer(args.student, False))
    teacher = load_model(args.teacher).model.float().eval()  # loaded once: its layer count and its perplexity
    n_teacher, teacher_ppl = teacher.config.num_hidden_layers, round(perplexity(teacher, windows), 4)
    del teacher
    kept = [i for i in range(n_teacher) if i not in set(parse_layers(args.dropped))]
    layer_map = boundary_mapped(kept, n_teacher)
    rows = []
    for name, over in json.loads(args.configs).items():
        stage = {"type": "distill", "student": args.student, "data": args.data,
                 "train_minutes": args.minutes, "warmup_steps": 3, **{k: v for k, v in over.items() if k != "loss"}}
        if "loss" in over:
            stage["loss"] = {"kl": 1.0, **over["loss"]}
            if any(k.startswith("hidden_") for k in over["loss"]):
                stage["layer_map"] = layer_map
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        recipe, out = work / f"{name}.yaml", work / name
        recipe.write_text(yaml.safe_dump({"model": args.teacher, "stages": [stage]}))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "geminicompress", "run", str(recipe), "-o", str(out), "--force", "-q",
                        "--threads", str(args.threads)], check=True, cwd=ROOT)
        result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
        ppl = score(str(out), windows)
        rows.append({"name": name, "options": over, "perplexity": ppl, "drift": round(ppl / teacher_ppl - 1, 4),
                     "tokens": result["tokens"], "tokens_per_s": result["tokens_per_s"],
                     "loss_first": result["loss_first"], "loss_last": result["loss_last"],
                     "held_ppl_curve": result["ppl_curve"], "wall_s": round(time.perf_counter() - t0, 1)})
        print(f"{name:>10}  ppl {ppl:8.2f}  drift {rows[-1]['drift']:+.1%}  tokens {result['tokens']:>7}", flush=True)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(
            {"teacher": args.teacher, "student": args.student, "dropped": args.dropped, "layer_map": layer_map,
             "minutes": args.minutes, "data": args.data, "threads": args.threads, "teacher_ppl": teacher_ppl,
             "rows": rows}, indent=1))
    print("\n| setting | perplexity | drift | tokens |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['perplexity']:.2f} | {r['drift']:+.1%} | {r['tokens']:,} |")


if __name__ == "__main__":
    main()
