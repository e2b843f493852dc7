"""Time per output token of the demo teacher and a 24-of-30-layer student (13-18 dropped), alternating,
in one process (issue #38). On a shared machine the figure is labelled CONTENDED and is not a bar figure.

    python benchmarks/studies/distill/student_tpot_contended.py
"""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import DATA, RESULTS, SEQ_LEN  # noqa: E402

from geminicompress.data import pack_windows, tokenize  # noqa: E402
from geminicompress.distill.student import derive_student  # noqa: E402
from geminicompress.eval.speculative import generation_speed  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402

torch.set_num_threads(2)
m = load_model("smollm2-demo")
t, tok = m.model, m.tokenizer
prompt = pack_windows(tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), 16384), SEQ_LEN)[:1, :128]
s, _ = derive_student(t, [i for i in range(30) if i not in range(13, 19)])  # TPOT does not depend on the weights
load = os.getloadavg()
rows: dict[str, list[float]] = {}
for _ in range(2):  # alternate, so changes in the machine's load hit both
    rows.setdefault("teacher", []).append(generation_speed(t, prompt, 64, repeats=5)["s_per_token"])
    rows.setdefault("student24", []).append(generation_speed(s, prompt, 64, repeats=5)["s_per_token"])
out = {"teacher_s_per_token": rows["teacher"], "student24_s_per_token": rows["student24"],
       "ratio": [b / a for a, b in zip(rows["teacher"], rows["student24"])], "load_average_before": load,
       "load_average_after": os.getloadavg(),
       "note": "greedy, 128-token prompt, 64 new tokens, median of 5, 2 threads, alternating; shared machine "
               "(load average): CONTENDED, not a bar figure"}
(RESULTS / "student_plan_bench_24_tpot_contended.json").write_text(json.dumps(out, indent=1))
print(out)
