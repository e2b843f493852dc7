"""`geminicompress eval`: quality drift vs latency gain of models against a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.core.errors import InputError


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise InputError(f"--batch-sizes must be positive integers separated by commas (e.g. 1,4,8), got '{text}'")
    return sizes


def eval_(
    models: List[str] = typer.Argument(..., help="Models to compare (any format geminicompress writes)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Reference MODEL (default: the first MODEL)."),
    data: str = typer.Option("builtin:pydoc", "--data", help="Evaluation text (file, hub dataset, builtin:pydoc)."),
    output: Path = typer.Option(..., "--output", "-o", help="Report directory (report.json, report.md, tradeoff.png)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per perplexity window (default: min(2048, context))."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate at most this many tokens of DATA."),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="Prompt tokens for latency (default 128 on a CPU, 512 on a GPU)."),
    gen_len: Optional[int] = typer.Option(None, "--gen-len", help="Tokens generated per timed run (default 32 on a CPU, 128 on a GPU)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="Throughput batch sizes (default 1,4 on a CPU, 1,4,8 on a GPU)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Timed runs per measurement (default 3 on a CPU, 5 on a GPU)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Untimed warm-up runs (default 1)."),
    no_latency: bool = typer.Option(False, "--no-latency", help="Quality only: skip timing."),
    no_quality: bool = typer.Option(False, "--no-quality", help="Latency only: skip perplexity, KL and agreement."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="lm-eval-harness tasks, comma separated (needs lm-eval)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft MODEL: also time speculative decoding of the baseline."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Perplexity/KL one decoder layer at a "
                                          "time read from disk, for models bigger than memory (default: for each "
                                          "model whose weights exceed half the available memory). Latency is not "
                                          "measured for a streamed model."),
    kernels: str = typer.Option("fast", "--kernels", help="fast: each format's own kernel on this device (torch's "
                                "int4 kernel, bf16 activations, for GPTQ/AWQ/pack-quantized; fbgemm for int8); "
                                "reference: our dequantizing loader (exact; packed formats are then not timed)."),
    dtype_baseline: bool = typer.Option(True, "--dtype-baseline/--no-dtype-baseline", help="When a model runs in "
                                        "another activation dtype than the baseline (int4 kernels: bf16), also time "
                                        "the baseline in that dtype (default on)."),
    engine: str = typer.Option("transformers", "--engine", help="transformers (in this process), vllm: load and "
                               "measure every model in vLLM, installed in its own venv (docs/serving.md), or "
                               "llama.cpp: every model as GGUF in llama-cpp-python (perplexity, KL over the "
                               "baseline's top 16 + rest: a lower bound, TTFT/TPOT at batch 1)."),
    device: str = c.DEVICE,
    allow_pickle: bool = c.PICKLE,
    **common: Any,
) -> None:
    """Compare models on the same text and machine: perplexity, KL, agreement, latency, memory, size.

    \b
    Example:
      geminicompress eval smollm2-demo out-w8a8 -o report \\
          --data ../shared/data/wikitext2-test.txt --max-tokens 16384
    """
    from pydantic import ValidationError

    from geminicompress.data import check_data_spec
    from geminicompress.eval.api import EvalSetup, evaluate
    from geminicompress.eval.report import write_report
    from geminicompress.eval.table import llama_lines, rich_table, same_dtype_lines
    from geminicompress.host.output import OutputDir, check_output_path
    from geminicompress.runtime.recipes.inputs import model_inputs
    from geminicompress.eval.config import EvalStage

    given = {"seq_len": seq_len, "max_tokens": max_tokens, "prompt_len": prompt_len, "gen_len": gen_len,
             "repeats": repeats, "warmup": warmup, "draft": draft,
             "batch_sizes": _batch_sizes(batch_sizes) if batch_sizes is not None else None,
             "tasks": [t.strip() for t in tasks.split(",") if t.strip()] if tasks is not None else None}
    try:
        options = EvalStage(type="eval", data=data, text_column=common["text_column"], latency=not no_latency,
                            quality=not no_quality, kernels=kernels, dtype_baseline=dtype_baseline, engine=engine,
                            vllm_python=common["vllm_python"], llama_python=common["llama_python"],
                            frame=common["frame"], **{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(f"--{'-'.join(str(p) for p in err['loc']).replace('_', '-')}: {err['msg']}") from exc
    check_data_spec(data)
    inputs = [pair for i, m in enumerate(models) for pair in model_inputs(f"model {i + 1}", m)]
    inputs += [*model_inputs("--baseline", baseline), *model_inputs("--draft", draft), ("--data", data),
               ("--vllm-python", common["vllm_python"]), ("--llama-python", common["llama_python"])]
    check_output_path(output, common["force"], inputs)
    dev = c.parse_device(device)
    choice = c.use_threads(common["threads"])
    report = evaluate(models, baseline or models[0], data, None, options, c.RichProgress(common["quiet"]),
                      setup=EvalSetup(device=dev, trust_remote_code=common["trust_remote_code"],
                                      allow_pickle=allow_pickle, stream=stream))
    with OutputDir(output, common["force"], inputs=inputs) as tmp:
        write_report(report, tmp)
    c.out_console.print(rich_table(report, c.out_console.width))
    for line in [*same_dtype_lines(report), *llama_lines(report)]:
        c.out_console.print(line, highlight=False, soft_wrap=True)
    c.console.print(f"[green]wrote[/] {output}  (report.json, report.md, tradeoff.png; {choice.reason})",
                    highlight=False, soft_wrap=True)
    failed = [m["name"] for m in report["models"] if m.get("error")]
    if failed:  # the report holds the others; a script must still see that a model it asked for was not measured
        c.console.print(f"[bold red]error:[/] {len(failed)} of {len(report['models'])} models failed: "
                        f"{', '.join(failed)} (why: report.json's models[].error)", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


eval_ = c.handle_errors(c.with_options(eval_, c.ENGINE_OPTIONS, before=None))
