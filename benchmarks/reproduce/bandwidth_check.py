"""Physical check: decode time per token against the weight bytes each token reads, for bf16, int8 and int4,
next to this machine's memory bandwidth, so the reader sees how close each is to the bandwidth limit.

At batch 1 a decode step multiplies one token by every weight matrix once, so it must read every weight
byte once: time per token >= bytes per token / bandwidth. Measured here, in one process:

- bandwidth: a read of a 1 GiB tensor (`sum`, read-only, like a GEMV's weights) and a copy (read + write),
  median of 5, with the torch threads eval uses;
- bytes per token: the bytes of every weight the step reads as the kernel stores it (int4: packed codes +
  scales/offsets; w8a8: int8 codes + scales, fbgemm's packed copy has the same size; int8 W8A16: fbgemm's
  fp16 copy of the codes, 2 bytes per weight; dense: the tensors in their dtype), the output head included
  (tied to the embeddings: read once per step, in the checkpoint's float dtype); the embedding
  lookup (one row) and the KV cache (a few MB at 128 tokens) are left out;
- TPOT: greedy decoding after a 128-token prompt, 32 new tokens, batch 1, median of 5 runs after 1
  warm-up (eval/cost/latency.py's greedy_run), each model through the kernel `eval` uses (eval/engines/torch_kernels.py).

    python benchmarks/reproduce/bandwidth_check.py --models-dir /work/serve-models --threads 2

Writes benchmarks/results/bandwidth_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import RESULTS, eval_windows  # noqa: E402

from geminicompress.eval.cost.latency import greedy_run, prompt_batch  # noqa: E402
from geminicompress.eval.engines.torch_kernels import use_fast_kernels  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402

GIB = 2**30


def bandwidth(threads: int, repeats: int = 5) -> dict:
    """GB/s of a 1 GiB read (sum) and copy (read + write bytes) with `threads` threads."""
    torch.set_num_threads(threads)
    src = torch.ones(GIB // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.sum(), dst.copy_(src)  # touch every page first
    reads, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        reads.append(GIB / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * GIB / (time.perf_counter() - t0) / 1e9)
    return {"threads": threads, "read_GBps": round(statistics.median(reads), 2),
            "copy_GBps": round(statistics.median(copies), 2)}


def bytes_per_token(model) -> dict:
    """Bytes of the weights one decode step reads, by kind: decoder linears and the head."""
    seen, linears, head = set(), 0, 0
    for name, module in model.named_modules():
        tensors = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
                   if t is not None and t.dim() >= 1 and t.numel() > 1]
        if not hasattr(module, "in_features") or not tensors:
            continue
        size = sum(t.numel() * t.element_size() for t in tensors if t.data_ptr() not in seen)
        if getattr(module, "kernel", None) == "fbgemm-fp16-codes":  # W8A16: fbgemm streams its fp16 copy
            size += module.weight.numel()  # 2 bytes per weight, not the int8 buffer's 1
        seen.update(t.data_ptr() for t in tensors)
        if name.endswith("lm_head"):
            head += size
        else:
            linears += size
    if head == 0:  # a tied head: the embedding matrix is the head's weight
        emb = model.get_input_embeddings().weight
        head = emb.numel() * emb.element_size()
    return {"linears_MB": round(linears / 1e6, 2), "head_MB": round(head / 1e6, 2),
            "total_MB": round((linears + head) / 1e6, 2)}


def tpot_ms(model, ids: torch.Tensor, runs: int = 5) -> dict:
    prompt = prompt_batch(ids, 1, 128)
    greedy_run(model, prompt, 32, torch.device("cpu"))
    times = [greedy_run(model, prompt, 32, torch.device("cpu")).decode_s / 31 * 1000 for _ in range(runs)]
    return {"median": round(statistics.median(times), 3), "min": round(min(times), 3), "max": round(max(times), 3)}


MODELS = {"bf16": ("smollm2-demo", torch.bfloat16), "fp32": ("smollm2-demo", torch.float32),
          "int8 (W8A16, fbgemm fp16-codes GEMM)": ("int8", None), "w8a8 (fbgemm INT8 GEMM)": ("w8a8", None),
          "int4 (gptq g64 default flags, torch int4 kernel, bf16)": ("gptq-g64-static", None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", default="/work/serve-models")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    root = Path(args.models_dir)
    bw = {t: bandwidth(t) for t in sorted({1, args.threads})}
    torch.set_num_threads(args.threads)
    ids = None
    rows = {}
    for label, (name, dtype) in MODELS.items():
        spec = name if name == "smollm2-demo" else str(root / name)
        loaded = load_model(spec, dtype=dtype or torch.float32)
        ids = ids if ids is not None else eval_windows(loaded.tokenizer, 1).flatten()
        choice = use_fast_kernels(loaded.model, torch.device("cpu"))
        size = bytes_per_token(loaded.model)
        t = tpot_ms(loaded.model, ids)
        achieved = size["total_MB"] / t["median"]  # MB/ms = GB/s
        rows[label] = {"model": spec, "kernel": choice.kernel, "activation_dtype": choice.activation_dtype, **size,
                       "tpot_ms": t, "achieved_GBps": round(achieved, 2),
                       "of_read_bandwidth": round(achieved / bw[args.threads]["read_GBps"], 3),
                       "floor_ms": round(size["total_MB"] / bw[args.threads]["read_GBps"], 2)}
        print(f"{label:42s} {size['total_MB']:8.1f} MB/token  TPOT {t['median']:7.2f} ms  "
              f"{achieved:6.2f} GB/s = {100 * rows[label]['of_read_bandwidth']:.0f}% of the {bw[args.threads]['read_GBps']} "
              f"GB/s read; floor {rows[label]['floor_ms']} ms", flush=True)
        del loaded
    out = {"benchmark": "bandwidth_check", "threads": args.threads, "bandwidth": list(bw.values()), "models": rows,
           "command": f"python benchmarks/reproduce/bandwidth_check.py --models-dir {args.models_dir} --threads {args.threads}",
           "machine": machine(), "versions": versions()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bandwidth_check.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"bandwidth: {bw}; wrote {RESULTS / 'bandwidth_check.json'}")


if __name__ == "__main__":
    main()
