"""A whole decode step of the demo in float32 for a batch of B sequences (B rows through every linear), and a
prefill, with its dense linears on each route kernels/cpu_dense.py chooses among: torch's `linear` (MKL), (W·Xᵀ)ᵀ
("few-rows"), oneDNN's inner product, and cpu_dense.py's own choice by rows ("cpu-dense": what eval and
serve-bench run). `--student DIR` times a second model the same way, and the table gives its step over the
model's per route (the serve-bench student row's TPOT ratio, without the serving loop). Each sequence has a
200-token prompt in its KV cache; median of 10 steps after 2; rounds alternate the routes and the models.

    python benchmarks/studies/serving/cpu_dense_decode.py [--batches 1,2,4,8] [--rounds 2] [--student DIR]

Run it with the machine quiet. Writes benchmarks/results/cpu_dense_decode.json (`--out`: elsewhere), with the CPU's
name: the routes' times depend on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS, cpu_name  # noqa: E402

from geminicompress.kernels.cpu_dense import CpuDenseLinear, few_rows_linear, onednn_linear  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402


class FewRows(nn.Linear):
    def forward(self, x):
        return few_rows_linear(x, self.weight, self.bias)


class OneDNN(nn.Linear):
    def forward(self, x):
        return onednn_linear(x, self.weight, self.bias)


ROUTES = {"linear": nn.Linear, "few-rows": FewRows, "onednn": OneDNN, "cpu-dense": CpuDenseLinear}


def _route(model, route: str) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = ROUTES[route]


@torch.no_grad()
def step_ms(model, batch: int, route: str) -> tuple[float, torch.Tensor]:
    _route(model, route)
    ids = torch.randint(0, 40000, (batch, 200), generator=torch.Generator().manual_seed(batch))
    out = model(ids, use_cache=True)
    cache, nxt, times, tokens = out.past_key_values, out.logits[:, -1:].argmax(-1), [], []
    for _ in range(12):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        tokens.append(nxt)
    return statistics.median(times[2:]) * 1e3, torch.cat(tokens, 1)


@torch.no_grad()
def prefill_ms(model, rows: int, route: str) -> float:
    _route(model, route)
    ids = torch.randint(0, 40000, (1, rows), generator=torch.Generator().manual_seed(rows))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--student", default=None, help="a second model (the distilled student) timed the same way")
    ap.add_argument("--batches", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--prefill", default="64,320", help="prompt lengths of one sequence, timed per route")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_dense_decode.json", help="the JSON written")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {"model": load_model(a.model).model.eval()}
    if a.student:
        models["student"] = load_model(a.student).model.eval()
    rows, routes = {}, list(ROUTES)
    print(f"{'what':>12} {'model':>8} " + " ".join(f"{r + ' ms':>13}" for r in routes) + "  same tokens")
    for b in map(int, a.batches.split(",")):
        got = {(n, r): [] for n in models for r in routes}
        same = {}
        for _ in range(a.rounds):
            for n, m in models.items():
                tokens = {}
                for r in routes:
                    ms, tokens[r] = step_ms(m, b, r)
                    got[(n, r)].append(ms)
                same[n] = {r: bool(torch.equal(tokens[r], tokens["linear"])) for r in routes}
        for n in models:
            med = {r: statistics.median(got[(n, r)]) for r in routes}
            rows[f"decode/{b}/{n}"] = {"ms": {r: got[(n, r)] for r in routes}, "median_ms": med,
                                       "same_tokens_as_linear": same[n]}
            print(f"{'decode b=' + str(b):>12} {n:>8} " + " ".join(f"{med[r]:>13.1f}" for r in routes) +
                  f"  {all(same[n].values())}", flush=True)
        if a.student:
            ratio = {r: rows[f"decode/{b}/student"]["median_ms"][r] / rows[f"decode/{b}/model"]["median_ms"][r]
                     for r in routes}
            rows[f"decode/{b}/student_over_model"] = ratio
            print(f"{'':>12} {'ratio':>8} " + " ".join(f"{ratio[r]:>13.3f}" for r in routes), flush=True)
    for n_tok in (map(int, a.prefill.split(",")) if a.prefill else ()):
        for n, m in models.items():
            got = {r: [prefill_ms(m, n_tok, r) for _ in range(a.rounds)] for r in routes}
            med = {r: statistics.median(v) for r, v in got.items()}
            rows[f"prefill/{n_tok}/{n}"] = {"ms": got, "median_ms": med}
            print(f"{'prefill ' + str(n_tok):>12} {n:>8} " + " ".join(f"{med[r]:>13.1f}" for r in routes), flush=True)
    path = a.out
    path.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "model": a.model, "student": a.student,
                                "threads": a.threads, "cpu": cpu_name(), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
