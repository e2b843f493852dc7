"""Distillation on one GPU (bf16 autocast, SDPA attention): tokens/s and peak memory.

Prepared for a session that is lent a GPU; NOT run yet (no GPU was available when it was written).
    python benchmarks/studies/distill/distill_gpu.py [--quick] [--steps 300] [--batch-size 8]
Demo teacher (30 layers) -> 15-layer student on ../shared/data/enwiki-sample.txt, forward KL at T=1,
AdamW with warm-up + cosine, through the same `geminicompress.distill.train.train` the CLI uses.
Writes benchmarks/results/distill_gpu.json: tokens/s (training only, after the first 5 warm-up
steps are excluded from the rate), peak allocated/reserved CUDA memory, held-out perplexity before/after,
and protocol perplexity (wikitext2, 32 x 512) of teacher and student.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))

from geminicompress.data import pack_windows, tokenize  # noqa: E402
from geminicompress.distill.student import derive_student, n_params  # noqa: E402
from geminicompress.distill.train import TrainRun, train  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402
from geminicompress.distill.config import DistillStage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("distill_gpu.py needs a CUDA GPU")
    dev = torch.device("cuda")
    steps = 10 if args.quick else args.steps
    loaded = load_model("smollm2-demo")
    teacher, tok = loaded.model, loaded.tokenizer
    teacher.config._attn_implementation = "sdpa"
    student, kept = derive_student(teacher, 0.5)
    student.config._attn_implementation = "sdpa"
    teacher.to(dev)
    eval_w = pack_windows(tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), 16384), 512, 32)
    windows = pack_windows(tokenize(tok, (DATA / "enwiki-sample.txt").read_text()), args.seq_len)
    train_w, held = windows[:-8], windows[-8:]
    cfg = DistillStage(type="distill", steps=steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                       warmup_steps=max(1, steps // 10), temperature=1.0, loss={"kl": 1.0}, precision="bf16",
                       gradient_checkpointing=args.gradient_checkpointing, eval_every=max(1, steps // 5),
                       eval_windows=8)
    res = {"machine": machine(), "versions": versions(), "gpu": torch.cuda.get_device_name(), "args": vars(args),
           "steps": steps, "kept_layers": kept, "student_params": n_params(student)}
    res["teacher_ppl"] = perplexity(teacher, eval_w, dev)
    res["undistilled_ppl"] = perplexity(student.to(dev), eval_w, dev)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as state:
        student, h = train(student, teacher, train_w, held, cfg, TrainRun(0, Path(state), dev))
    torch.cuda.synchronize()
    res.update({"wall_s": time.perf_counter() - t0, "train_s": h.seconds, "tokens": h.tokens,
                "tokens_per_s": h.tokens / h.seconds, "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "loss": h.loss,
                "held_out_ppl": h.ppl, "kd_ppl": perplexity(student, eval_w, dev)})
    out = ROOT / "benchmarks" / "results" / ("distill_gpu_quick.json" if args.quick else "distill_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"{res['tokens_per_s']:.0f} tokens/s, peak {res['peak_allocated_gib']:.2f} GiB, "
          f"ppl teacher {res['teacher_ppl']:.2f} / un-distilled {res['undistilled_ppl']:.1f} / KD {res['kd_ppl']:.2f}")


if __name__ == "__main__":
    main()
