"""GPTQ solver variants through the real pipeline, one perplexity each: the ablation behind the defaults.

Each variant is a JSON object: `stage` (GPTQStage fields over its defaults, as `quantize` flags set them),
and optionally `solver` (keyword arguments of `gptq_quantize` that override what the stage passes, for
variants no flag exposes) and `solver_by_in` ({input width: keyword arguments} over those, e.g. only for
the demo's down_proj, the one linear with 1536 inputs). The demo model goes through the gptq stage in this process (true-sequential,
one pass, fake-quantized in memory with the scales rounded to the checkpoint's dtype: the weights the
checkpoint would hold), then perplexity. Protocol: the project's (benchmarks/common.py): 32 x 512
calibration windows of enwiki-sample.txt, seed 0; WikiText-2 test, first 16,384 tokens, 512-token windows.

  python benchmarks/studies/gptq/gptq_variants.py --name gptq_variants_static \\
      --variants '[{"stage": {"act_order": "static"}}, {"stage": {"act_order": "none"}}]'
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
    from geminicompress.models.loading import load_model

    loaded = load_model(str(demo))
    options = {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 64, **variant.get("stage", {})}
    ctx = stage_context(demo, loaded, options, calib, work, None)
    solver_kwargs = variant.get("solver", {})
    by_width = {int(k): v for k, v in variant.get("solver_by_in", {}).items()}
    original = gptq_stage.gptq_quantize
    if solver_kwargs or by_width:
        gptq_stage.gptq_quantize = functools.partial(_with, original, solver_kwargs, by_width)
    try:
        t0 = time.perf_counter()
        summary = gptq_stage.run(GPTQStage(**options), ctx)
        seconds = time.perf_counter() - t0
    finally:
        gptq_stage.gptq_quantize = original
    shutil.rmtree(work, ignore_errors=True)
    return {"variant": variant, "ppl": round(perplexity(loaded.model, eval_ids), 3),
            "stage_seconds_shared_machine": round(seconds, 1), "total_error": round(summary["total_error"], 4)}


def _with(solver, extra: dict, by_width: dict, W, H, spec, opts=None, **kwargs):
    """The solver with `extra` options (solver.SolverOptions fields, or keep_zero/overwrite), and those of
    by_width[input width] over them; `refit: n` refits the scales n times after the solve
    (benchmarks/studies/gptq/refit.py)."""
    from geminicompress.compress.gptq.solver import SolverOptions

    given = {**extra, **by_width.get(W.shape[1], {})}
    refit = given.pop("refit", 0)
    fields = {f.name for f in dataclasses.fields(SolverOptions)}
    opts = dataclasses.replace(opts or SolverOptions(), **{k: v for k, v in given.items() if k in fields})
    kwargs = {**kwargs, **{k: v for k, v in given.items() if k not in fields}, "opts": opts}
    if not refit:
        return solver(W, H, spec, **kwargs)
    from studies.gptq.refit import refit_scales

    W0, H0 = W.clone(), H.clone()
    qw, loss = solver(W, H, spec, **kwargs)
    for _ in range(refit):
        qw = refit_scales(qw, W0, H0)
    return qw, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True, help="JSON list of {stage: {...}, solver: {...}}")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--name", required=True, help="results file name without .json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    demo = demo_dir()
    tok = load_model(str(demo)).tokenizer
    calib, eval_ids = calibration_ids(tok, args.samples), eval_windows(tok)
    path = RESULTS / f"{args.name}.json"
    meta = {"benchmark": "gptq variants", "command": "python " + " ".join(sys.argv),
            "calibration": f"{args.samples} x 512 tokens, enwiki-sample.txt, seed 0",
            "perplexity": f"wikitext2-test.txt, first {eval_ids.numel()} tokens, {len(eval_ids)} x 512",
            "machine": machine(), "versions": versions()}
    rows = []
    for variant in json.loads(args.variants):
        rows.append(run_variant(demo, calib, eval_ids, variant, Path(tempfile.mkdtemp(prefix="gc-gptq-var-"))))
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
