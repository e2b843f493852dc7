"""The `eval` recipe stage: compare the checkpoint just written to OUT with the recipe's input model.

The pipeline exports OUT before eval stages run, so this loads back from disk exactly what ships and
writes OUT/eval/{report.json, report.md, tradeoff.png}; the run's report.json gets a compact summary.
"""

from __future__ import annotations

import json

from geminicompress.eval.api import EvalSetup, evaluate
from geminicompress.eval.report import write_report
from geminicompress.eval.table import summary_line
from geminicompress.host.output import final_name
from geminicompress.eval.config import EvalStage

REPORT_FOLDER = "eval"


def run(cfg: EvalStage, ctx) -> dict:
    recipe = ctx.recipe
    out_name = final_name(ctx.out_dir)
    report = evaluate([str(ctx.out_dir)], recipe.model, cfg.data or recipe.calibration.data, None,
                      cfg if cfg.frame else cfg.model_copy(update={"frame": recipe.frame}), ctx.progress,
                      setup=EvalSetup(device=ctx.device, names={str(ctx.out_dir): out_name},
                                      trust_remote_code=recipe.trust_remote_code, allow_pickle=recipe.allow_pickle))
    model = report["models"][-1]
    model["path"] = str(ctx.out_dir.with_name(out_name))  # where it will be once the run completes
    write_report(report, ctx.out_dir / REPORT_FOLDER)
    serving = _serving(cfg, ctx) if cfg.serving is not None else None
    return {
        "serving": serving,
        "report": f"{REPORT_FOLDER}/report.json",
        "summary": summary_line(report, model),
        "quality": model["quality"],
        "latency": {k: (model["latency"] or {}).get(k) for k in ("ttft_ms", "tpot_ms", "throughput_tok_s")},
        "size_mb": model["size_mb"],
        "notes": [n for m in report["models"] for n in m["notes"]],
    }


def is_w8a8(folder) -> bool:
    """The folder holds a compressed-tensors int-quantized checkpoint with quantized input activations."""
    try:
        qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    groups = (qc.get("config_groups") or {}).values()
    return qc.get("format") == "int-quantized" and any(g.get("input_activations") for g in groups)


def served_outputs(out_dir, distills: bool) -> dict[str, str | None]:
    """Which serving rows the recipe's output takes: a student (served in the teacher's place, and as the
    draft of speculative decoding) when the recipe distills; else INT8 when W8A8, INT4 (and the draft: a
    quantized copy of the model) when 4-bit."""
    from geminicompress.eval.engines.torch_kernels import expects_int4

    out = str(out_dir)
    try:
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if distills:
        return {"student": out, "draft": out}
    if is_w8a8(out_dir):
        return {"int8": out}
    if expects_int4(config):
        return {"int4": out, "draft": out}
    return {}


def _serving(cfg: EvalStage, ctx) -> dict:
    """The serving table of the recipe's model into OUT/eval/serving/; OUT takes the rows it applies to."""
    from geminicompress.eval.serving import table as serve_table
    from geminicompress.eval.serving.bench import ServeOptions, serve_bench
    from geminicompress.eval.serving.servers import Models
    from geminicompress.eval.serving.workload import WorkloadSpec

    s, recipe = cfg.serving, ctx.recipe
    spec = WorkloadSpec(s.requests, s.prefix_len, s.question_len, s.answer_len, s.rate, s.max_prompt_len, s.seed)
    options = ServeOptions(engine=cfg.engine, max_batch=s.max_batch, ppl_tokens=s.ppl_tokens,
                           text_column=cfg.text_column, vllm_python=cfg.vllm_python, dtype=s.dtype,
                           trust_remote_code=recipe.trust_remote_code, frame=cfg.frame or recipe.frame, load=s.load,
                           concurrency=s.concurrency)
    outputs = served_outputs(ctx.out_dir, any(st.makes_student for st in recipe.stages))
    report = serve_bench(Models(recipe.model, **outputs), cfg.data or recipe.calibration.data, spec, options,
                         ctx.progress)
    final = str(ctx.out_dir.with_name(final_name(ctx.out_dir)))
    for key in outputs:
        report[key] = final  # where OUT will be once the run completes
    serve_table.write(report, ctx.out_dir / REPORT_FOLDER / "serving")
    return {"report": f"{REPORT_FOLDER}/serving/serving.json", "load": report["load"],
            "rows": {r["row"]: {"mark": r["mark"], "capacity_req_s": r["capacity_req_s"]} for r in report["rows"]}}
