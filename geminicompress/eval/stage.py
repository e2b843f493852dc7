"""The `eval` recipe stage: compare the checkpoint just written to OUT with the recipe's input model.

The pipeline exports OUT before eval stages run, so this loads back from disk exactly what ships and
writes OUT/eval/{report.json, report.md, tradeoff.png}; the run's report.json gets a compact summary.
"""

from __future__ import annotations

from geminicompress.eval.api import evaluate
from geminicompress.eval.report import write_report
from geminicompress.eval.table import summary_line
from geminicompress.recipes.schema import EvalStage

REPORT_FOLDER = "eval"


def final_name(partial: str) -> str:
    """`.out.partial` -> `out`: the name the output will have once the run completes."""
    return partial.removeprefix(".").removesuffix(".partial")


def run(cfg: EvalStage, ctx) -> dict:
    recipe = ctx.recipe
    out_name = final_name(ctx.out_dir.name)
    report = evaluate(
        [str(ctx.out_dir)],
        recipe.model,
        cfg.data or recipe.calibration.data,
        None,
        cfg,
        ctx.progress,
        device=ctx.device,
        names={str(ctx.out_dir): out_name},
        trust_remote_code=recipe.trust_remote_code,
        allow_pickle=recipe.allow_pickle,
    )
    model = report["models"][-1]
    model["path"] = str(ctx.out_dir.with_name(out_name))  # where it will be once the run completes
    write_report(report, ctx.out_dir / REPORT_FOLDER)
    return {
        "report": f"{REPORT_FOLDER}/report.json",
        "summary": summary_line(report, model),
        "quality": model["quality"],
        "latency": {k: (model["latency"] or {}).get(k) for k in ("ttft_ms", "tpot_ms", "throughput_tok_s")},
        "size_mb": model["size_mb"],
        "notes": [n for m in report["models"] for n in m["notes"]],
    }
