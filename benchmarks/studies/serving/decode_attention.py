"""What a decode step's attention costs on a CPU: torch's scaled_dot_product_attention (what transformers' "sdpa"
calls: the flash-attention CPU kernel) against a plain matmul-softmax computed in float32, for one query token
(a decode step) and a few (a speculative verification), the demo's heads (9 query heads on 3 KV heads, 64 wide),
float32 and bfloat16 inputs. Each figure: one layer's attention, median of --repeats; the error is the largest
absolute difference from a float32 reference.

    python benchmarks/studies/serving/decode_attention.py [--contexts 300,1000] [--queries 1,5] [--profile MODEL]

`--profile MODEL`: also a torch-profiler table of 5 decode steps of MODEL as `eval` and `serve-bench` run it (its
fast kernels) but on transformers' sdpa, after a 300-token prompt: which ops a step spends its time in (e.g. the
INT4 draft of the serving table, which computes in bf16); then its whole decode step (median of 12 after 2, two
rounds alternating) on sdpa and on kernels/decode_attention.py after each of --contexts prompt tokens, and
whether the 14 greedy tokens are the same. Run it with the machine quiet. Writes
benchmarks/results/decode_attention.json (`--out`: elsewhere), with the CPU's name: the kernels' times depend on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS, cpu_name, time_us  # noqa: E402

from geminicompress.kernels.decode_attention import grouped_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64  # the demo's attention (SmolLM2-135M)


def _causal(n: int, length: int) -> torch.Tensor | None:
    """For n > 1 query tokens, the last n of `length`: query i sees the cache and the queries up to i."""
    return None if n == 1 else torch.arange(length) <= torch.arange(length - n, length).unsqueeze(1)


def matmul_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The package's float32 math (decode_attention.grouped_attention), as (1, H, Q, D) like sdpa's."""
    mask = _causal(q.shape[2], k.shape[2])
    return grouped_attention(q, k, v, None if mask is None else mask[None, None], q.shape[-1] ** -0.5).transpose(1, 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q.shape[2], k.shape[2]), enable_gqa=True)


@torch.no_grad()
def step_ms(model, impl: str, context: int) -> tuple[float, torch.Tensor]:
    model.set_attn_implementation(impl)
    out = model(torch.randint(0, 40000, (1, context), generator=torch.Generator().manual_seed(0)), use_cache=True)
    cache, nxt, times, tokens = out.past_key_values, out.logits[:, -1:].argmax(-1), [], []
    for _ in range(14):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens.append(nxt)
    return statistics.median(times[2:]) * 1e3, torch.cat(tokens, 1)


def profile(path: str, contexts: list[int]) -> tuple[str, dict]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from geminicompress.eval.engines.torch_kernels import use_fast_kernels
    from geminicompress.kernels.decode_attention import NAME
    from geminicompress.models.loading import load_model

    model = load_model(path).model.eval()
    choice = use_fast_kernels(model, torch.device("cpu"))
    steps = {}
    for context in contexts:
        got, tokens = {"sdpa": [], NAME: []}, {}
        for _ in range(2):
            for impl in got:
                ms, tokens[impl] = step_ms(model, impl, context)
                got[impl].append(ms)
        steps[context] = {"ms": got, "median_ms": {k: statistics.median(v) for k, v in got.items()},
                          "same_tokens": bool(torch.equal(tokens["sdpa"], tokens[NAME]))}
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(torch.randint(0, 40000, (1, 300), generator=torch.Generator().manual_seed(0)), use_cache=True)
        cache = out.past_key_values
        for _ in range(2):
            out = model(torch.tensor([[7]]), past_key_values=cache, use_cache=True)
        with torch_profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                out = model(torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    return f"{path}: kernel {choice.kernel} ({choice.activation_dtype}), 5 decode steps on sdpa\n" + \
        p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--queries", default="1,5")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", default=None, help="a model to profile 5 decode steps of")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json", help="the JSON written")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = {}
    print(f"{'dtype':>9} {'queries':>7} {'context':>7} {'sdpa us':>9} {'matmul us':>10} {'ratio':>6} "
          f"{'sdpa err':>9} {'matmul err':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        for n in map(int, a.queries.split(",")):
            for length in map(int, a.contexts.split(",")):
                q = torch.randn(1, HEADS, n, DIM, generator=g).to(dtype)
                k, v = (torch.randn(1, KV_HEADS, length, DIM, generator=g).to(dtype) for _ in range(2))
                ref = sdpa(q.float(), k.float(), v.float())
                t_sdpa, t_mm = time_us(lambda: sdpa(q, k, v), a.repeats), time_us(lambda: matmul_softmax(q, k, v),
                                                                                  a.repeats)
                err = {name: float((f(q, k, v).float() - ref).abs().max()) for name, f in
                       (("sdpa", sdpa), ("matmul", matmul_softmax))}
                ratio = t_mm["median_us"] / t_sdpa["median_us"]
                key = f"{str(dtype).removeprefix('torch.')}/q{n}/L{length}"
                rows[key] = {"sdpa": t_sdpa, "matmul_softmax": t_mm, "ratio": round(ratio, 3), "max_abs_err": err}
                print(f"{key.split('/')[0]:>9} {n:>7} {length:>7} {t_sdpa['median_us']:>9.1f} "
                      f"{t_mm['median_us']:>10.1f} {ratio:>6.2f} {err['sdpa']:>9.1e} {err['matmul']:>10.1e}",
                      flush=True)
    prof, steps = profile(a.profile, [int(c) for c in a.contexts.split(",")]) if a.profile else (None, None)
    if prof:
        print(prof)
        print(f"{'context':>7} {'sdpa ms':>8} {'decode_attention ms':>20} {'same tokens':>12}")
        for context, r in steps.items():
            med = list(r["median_ms"].values())
            print(f"{context:>7} {med[0]:>8.1f} {med[1]:>20.1f} {str(r['same_tokens']):>12}")
    path = a.out
    path.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "cpu": cpu_name(), "threads": a.threads,
                                "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "rows": rows, "profile": prof,
                                "model_steps": steps}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
