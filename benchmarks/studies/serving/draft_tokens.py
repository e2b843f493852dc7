"""How many draft tokens a round, and our loop against transformers' assisted generation: TPOT alone.

The speculative row of `serve-bench` (eval/serving/assisted.py) on the demo with its INT4 copy as draft. Each
configuration serves the same requests one at a time, alone (concurrency 1, after a warm-up), on the stack's
attention (sdpa); rounds alternate the configurations, and the table gives each one's median TPOT over every
request of every round and its ratio to the verifier alone (hf.py's one-request loop, the same model and flags).

    python benchmarks/studies/serving/draft_tokens.py --int4 INT4_DIR [--model smollm2-demo] [--rounds 3]

`--routes cpu-dense,linear`: each round also with the dense linears on torch's own route for every row count (the
models as loaded, before kernels/cpu_dense.py; "cpu-dense" is what serve-bench runs), the routes alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from geminicompress.data import read_text, text_prefix, tokenize
from geminicompress.eval.serving.assisted import serve_assisted
from geminicompress.eval.serving.hf import HFFlags, serve
from geminicompress.eval.serving.servers import HFServer, Models
from geminicompress.eval.serving.workload import WorkloadSpec, build_workload
from geminicompress.kernels.cpu_dense import CpuDenseLinear
from geminicompress.eval.cost import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import cpu_name  # noqa: E402


def _hf_assisted(model, draft, requests, n):
    """TPOT of transformers' assisted generation (the row before this study), its default schedule."""
    out = []
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, assistant_model=draft,
                  pad_token_id=0, eos_token_id=None)
    for m in (model, draft):
        m.generation_config.eos_token_id = None
    for r in requests:
        ids = torch.tensor([r.prompt(None)])
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        out.append((time.perf_counter() - t0) / n)  # whole generation per token (TTFT included): an upper bound
    return out


def _route(route: str, *models) -> None:
    """The dense linears of `models` on cpu_dense.py's routes (as serve-bench loads them) or torch's own."""
    for model in models:
        for m in model.modules():
            if type(m) in (torch.nn.Linear, CpuDenseLinear):
                m.__class__ = CpuDenseLinear if route == "cpu-dense" else torch.nn.Linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--int4", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="leave out transformers' assisted generation")
    ap.add_argument("--routes", default="cpu-dense", help="cpu-dense and/or linear, comma separated")
    ap.add_argument("--out", default="benchmarks/results/draft_tokens.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    spec = WorkloadSpec(requests=a.requests)
    tok = plan.peek_tokenizer(a.model, False)
    ids = tokenize(tok, read_text("builtin:pydoc", "text"), None)
    prefix = text_prefix(tok, "tokenizer", None)
    requests, _ = build_workload(torch.cat([torch.tensor(prefix, dtype=ids.dtype), ids]), spec)
    server = HFServer(Models(a.model, draft=a.int4), spec, None, "auto", False)
    (model, _), (draft, choice) = server.need(["base", "draft"])
    model.set_attn_implementation("sdpa")
    ks = [int(k) for k in a.ks.split(",")]
    tpot: dict[str, list[float]] = {}
    acc: dict[str, dict] = {}
    routes = a.routes.split(",")
    for rnd in range(a.rounds):
        for route in routes:
            _route(route, model, draft)
            tag = "" if len(routes) == 1 else f" [{route}]"
            alone = serve(model, requests, HFFlags(attn="sdpa"), spec.truncated_len, spec.prefix_len, rnd == 0, 1)
            tpot.setdefault("alone" + tag, []).extend(t.tpot for t in alone)
            for k in ks:
                timings, counts = serve_assisted(model, draft, requests, None, rnd == 0, 1, k)
                tpot.setdefault(f"k={k}{tag}", []).extend(t.tpot for t in timings)
                acc[f"k={k}{tag}"] = counts
                same = sum(a_ == b_ for x, y in zip(timings, alone) for a_, b_ in zip(x.tokens, y.tokens))
                acc[f"k={k}{tag}"]["same_tokens"] = same / sum(len(x.tokens) for x in alone)
        if a.hf:  # on the first route
            _route(routes[0], model, draft)
            tpot.setdefault("hf assisted (whole/token)", []).extend(_hf_assisted(model, draft, requests,
                                                                                spec.answer_len))
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {1e3 * statistics.median(v):.1f}" for k, v in tpot.items()), flush=True)
    base = {k: statistics.median(v) for k, v in tpot.items() if k.startswith("alone")}

    def alone_of(config: str) -> float:  # the verifier alone on the same route
        tag = config[config.index(" ["):] if " [" in config else ("" if len(routes) == 1 else f" [{routes[0]}]")
        return base["alone" + tag]

    rows = [{"config": k, "tpot_ms": round(1e3 * statistics.median(v), 2),
             "x_alone": round(statistics.median(v) / alone_of(k), 3),
             **({kk: vv for kk, vv in acc[k].items()} if k in acc else {})} for k, v in tpot.items()]
    print("| config | TPOT ms (median) | x verifier alone | accepted / proposed | per round | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['accepted'] / max(1, r['proposed']):.1%}" if "accepted" in r else ""
        per = f"{r['accepted'] / max(1, r['rounds']):.2f}" if "accepted" in r else ""
        same = f"{r['same_tokens']:.1%}" if "same_tokens" in r else ""
        print(f"| {r['config']} | {r['tpot_ms']} | {r['x_alone']} | {rate} | {per} | {same} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "cpu": cpu_name(),
                                       "draft_kernel": choice.kernel, "rows": rows, "tpot_s": tpot}, indent=1))


if __name__ == "__main__":
    main()
