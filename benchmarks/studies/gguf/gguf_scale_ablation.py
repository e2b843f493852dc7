"""What each ingredient of GPTQ's scale choice for GGUF (Q4_0/Q5_0 grids) buys: GPTQ through the real stage in
this process, one perplexity per variant (torch, fake-quantized weights with fp16 scales: what a Q4_0/Q5_0
block holds).

A variant is a JSON object: `stage` (GPTQStage fields over bits 4, group 32, format dense), `solver` (extra
keyword arguments of solver.gptq_quantize, e.g. {"order": "gar"}), `search`
(compress/scale_search.ScaleSearch fields; absent: the stage's own choice), `refit` (n: least-squares refits of
the scales under the layer's H after the solve, benchmarks/studies/gptq/refit.py, sign kept). Protocol: 32 x 512
calibration windows of enwiki-sample.txt (seed 0; `--samples`), perplexity on the first 8,192 WikiText-2 test
tokens in 512-token windows (the issue's llama.cpp protocol).

  python benchmarks/studies/gguf/gguf_scale_ablation.py --name gguf_scale_ablation \\
      --variants '[{}, {"search": {"signed": true}}, {"search": {"signed": true, "weights": "llama"}}]'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import RESULTS, calibration_ids, eval_windows, perplexity, stage_context  # noqa: E402


def run_variant(demo: Path, calib: torch.Tensor, eval_ids: torch.Tensor, variant: dict, work: Path) -> dict:
    from geminicompress.compress.gptq import stage as gptq_stage
    from geminicompress.compress.gptq.config import GPTQStage
    from geminicompress.compress.scale_search import ScaleSearch
    from geminicompress.models.loading import load_model
    from geminicompress.runtime.stages import run_stage

    loaded = load_model(str(demo))
    options = {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 32, "format": "dense",
               **variant.get("stage", {})}
    ctx = stage_context(demo, loaded, options, calib, work, None)
    saved = gptq_stage.scale_search, gptq_stage.scale_dtype, gptq_stage.gptq_quantize
    if "search" in variant:
        search = ScaleSearch(**variant["search"]) if variant["search"] is not None else None
        gptq_stage.scale_search = lambda cfg, spec: search
    gptq_stage.scale_dtype = lambda fmt, dtype: torch.float16  # GGUF blocks hold fp16 scales
    if variant.get("refit") or variant.get("solver"):
        gptq_stage.gptq_quantize = _refitting(saved[2], variant.get("refit", 0), variant.get("solver", {}))
    try:
        t0 = time.perf_counter()
        _, summary, _ = run_stage(GPTQStage(**options), ctx)
        seconds = time.perf_counter() - t0
    finally:
        gptq_stage.scale_search, gptq_stage.scale_dtype, gptq_stage.gptq_quantize = saved
    shutil.rmtree(work, ignore_errors=True)
    return {"variant": variant, "ppl": round(perplexity(loaded.model, eval_ids), 3),
            "stage_seconds_shared_machine": round(seconds, 1), "total_error": round(summary["total_error"], 4)}


def _refitting(solver, n: int, extra: dict):
    """The solver with `extra` keyword arguments (e.g. order), then n least-squares refits of its scales."""
    from studies.gptq.refit import refit_scales

    def solve(W, H, spec, opts, **kwargs):
        opts = dataclasses.replace(opts, **extra)
        if not n:
            return solver(W, H, spec, opts, **kwargs)
        W0, H0 = W.clone(), H.clone()
        kwargs["overwrite"] = False
        qw, loss = solver(W, H, spec, opts, **kwargs)
        for _ in range(n):
            qw = refit_scales(qw, W0, H0)
        return qw, loss
    return solve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True, help="JSON list of {stage: {...}, search: {...}, refit: n}")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--name", required=True, help="results file name without .json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    demo = demo_dir()
    tok = load_model(str(demo)).tokenizer
    calib, eval_ids = calibration_ids(tok, args.samples), eval_windows(tok, args.tokens // 512)
    path = RESULTS / f"{args.name}.json"
    meta = {"benchmark": "gptq scale choice for GGUF grids", "command": "python " + " ".join(sys.argv),
            "calibration": f"{args.samples} x 512 tokens, enwiki-sample.txt, seed 0",
            "perplexity": f"wikitext2-test.txt, first {eval_ids.numel()} tokens, {len(eval_ids)} x 512, torch fp32",
            "machine": machine(), "versions": versions()}
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for variant in json.loads(args.variants):
        rows.append(run_variant(demo, calib, eval_ids, variant, Path(tempfile.mkdtemp(prefix="gc-gguf-var-"))))
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
