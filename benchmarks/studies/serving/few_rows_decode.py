"""A whole decode step of the demo in float32 for a batch of B sequences (B rows through every linear), with its
linears on torch's route (`linear`) and on kernels/few_rows.py's: what the few-rows route buys where it is used,
the ops after the linears included. Each sequence has a 200-token prompt in its KV cache; median of 8 steps after
2, the routes alternating, `--rounds` times.

    python benchmarks/studies/serving/few_rows_decode.py [--batches 1,2,4,8] [--rounds 2]

Run it with the machine quiet. Writes benchmarks/results/few_rows_decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS  # noqa: E402

from geminicompress.kernels.few_rows import FewRowsLinear  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402

ROUTES = {"linear": torch.nn.Linear, "few-rows": FewRowsLinear}


@torch.no_grad()
def step_ms(model, batch: int, route: str) -> float:
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.__class__ = ROUTES[route]
    ids = torch.randint(0, 40000, (batch, 200), generator=torch.Generator().manual_seed(batch))
    out = model(ids, use_cache=True)
    cache, nxt, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(10):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt = out.logits[:, -1:].argmax(-1)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--batches", default="1,2,4,6,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model).model.eval()
    rows = {}
    print(f"{'batch':>5} {'linear ms':>10} {'few-rows ms':>12} {'ratio':>6}")
    for b in map(int, a.batches.split(",")):
        got = {r: [] for r in ROUTES}
        for _ in range(a.rounds):
            for r in ROUTES:
                got[r].append(step_ms(model, b, r))
        med = {r: statistics.median(v) for r, v in got.items()}
        rows[b] = {"ms": got, "median_ms": med, "ratio": round(med["few-rows"] / med["linear"], 3)}
        print(f"{b:>5} {med['linear']:>10.1f} {med['few-rows']:>12.1f} {rows[b]['ratio']:>6.2f}", flush=True)
    path = RESULTS / "few_rows_decode.json"
    path.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "model": a.model, "threads": a.threads,
                                "batches": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
