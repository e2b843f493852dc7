"""`geminicompress serve-bench`: the serving table: one workload, one row per serving optimization."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from geminicompress.commands import common as c


def serve_bench(
    model: str = typer.Argument(..., help="MODEL to serve: a local directory or smollm2-demo."),
    output: Path = typer.Option(..., "--output", "-o", help="Report directory (serving.json, serving.md, serving.png)."),
    int8: Optional[str] = typer.Option(None, "--int8", help="The W8A8 output of MODEL, for the INT8 row (from "
                                       "`quantize MODEL -o OUT --method w8a8`); without it the row says so."),
    int4: Optional[str] = typer.Option(None, "--int4", help="The GPTQ output of MODEL, for the INT4 row (through "
                                       "torch's int4 kernel)."),
    student: Optional[str] = typer.Option(None, "--student", help="A distilled student of MODEL (`distill`), served "
                                          "in its place."),
    draft: Optional[str] = typer.Option(None, "--draft", help="A draft model with MODEL's tokenizer, for the "
                                        "speculative decoding row (greedy, exact)."),
    engine: str = typer.Option("transformers", "--engine", help="transformers (this process), vllm or llama.cpp "
                               "(GGUF files; each in its own venv, docs/serving.md)."),
    data: str = typer.Option("builtin:pydoc", "--data", help="Text the prefix, the questions and the perplexity "
                             "windows are cut from."),
    requests: int = typer.Option(32, "--requests", help="Requests in the workload."),
    prefix_len: int = typer.Option(256, "--prefix-len", help="Tokens of the system prefix every request shares."),
    question_len: int = typer.Option(128, "--question-len", help="Tokens of each request's own question."),
    answer_len: int = typer.Option(32, "--answer-len", help="Tokens generated per request (greedy, EOS ignored)."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Arrival rate of the timed rows, requests per second "
                                         "(Poisson), instead of --load."),
    load: Optional[float] = typer.Option(None, "--load", help="Arrival rate of the timed rows as a share of the "
                                         "stack's capacity measured in the same run (default 0.7)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="The timed rows as N clients in a closed "
                                              "loop (each sends its next request when its answer is done), "
                                              "instead of --load."),
    max_prompt_len: Optional[int] = typer.Option(None, "--max-prompt-len", help="Prompt length of the truncation "
                                                 "row (default: prefix + half the question)."),
    max_batch: int = typer.Option(8, "--max-batch", help="Largest batch of the batching rows (vLLM: max_num_seqs)."),
    ppl_tokens: int = typer.Option(4096, "--ppl-tokens", help="Tokens of DATA for the perplexity of rows that "
                                   "change the model (512-token windows; 0 = none)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (as stored), float32 or bfloat16."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrival times."),
    **common: Any,
) -> None:
    """Serve one workload row after row, each row adding one optimization to the best row above it:
    original configuration, prompt truncation, FlashAttention, KV-cache reuse, dynamic batching,
    PagedAttention, INT8, INT4, the distilled student, speculative decoding. A row joins the stack when it
    serves more requests/s in a burst at equal answers; the timed rows run at --load x the stack's
    capacity. Columns: stack, burst req/s, TTFT alone and p50/p90 under load, TPOT, KV-cache hit rate,
    answer agreement with the first row, perplexity drift of rows that change the model.

    \b
    Examples:
      geminicompress quantize smollm2-demo -o out-w8a8 --method w8a8
      geminicompress serve-bench smollm2-demo --int8 out-w8a8 -o serving
      geminicompress serve-bench smollm2-demo --int8 out-w8a8 --int4 out-gptq \\
          --student student --draft out-gptq -o serving
      geminicompress serve-bench smollm2-demo --int8 out-w8a8 -o serving-vllm \\
          --engine vllm --vllm-python ~/venv-vllm/bin/python
    """
    from geminicompress.data import check_data_spec
    from geminicompress.core.errors import InputError
    from geminicompress.eval.serving import table as serve_table
    from geminicompress.eval.serving.bench import ServeOptions
    from geminicompress.eval.serving.bench import serve_bench as run
    from geminicompress.eval.serving.servers import Models
    from geminicompress.eval.serving.workload import WorkloadSpec
    from geminicompress.host.output import OutputDir, check_output_path
    from geminicompress.runtime.recipes.inputs import model_inputs

    if engine not in ("transformers", "vllm", "llama.cpp"):
        raise InputError(f"--engine must be transformers, vllm or llama.cpp, got '{engine}'")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise InputError(f"--dtype must be auto, float32 or bfloat16, got '{dtype}'")
    check_data_spec(data)
    inputs = [*model_inputs("model", model), *model_inputs("--int8", int8), *model_inputs("--int4", int4),
              *model_inputs("--student", student), *model_inputs("--draft", draft), ("--data", data),
              ("--vllm-python", common["vllm_python"]), ("--llama-python", common["llama_python"])]
    check_output_path(output, common["force"], inputs)
    spec = WorkloadSpec(requests, prefix_len, question_len, answer_len, rate, max_prompt_len, seed)
    choice = c.use_threads(common["threads"])
    options = ServeOptions(engine=engine, max_batch=max_batch, ppl_tokens=ppl_tokens,
                           text_column=common["text_column"], vllm_python=common["vllm_python"],
                           llama_python=common["llama_python"], dtype=dtype,
                           trust_remote_code=common["trust_remote_code"], frame=common["frame"], load=load,
                           concurrency=concurrency)
    report = run(Models(model, int8, int4, student, draft), data, spec, options, c.RichProgress(common["quiet"]))
    with OutputDir(output, common["force"], inputs=inputs) as tmp:
        serve_table.write(report, tmp)
    c.out_console.print(serve_table.rich_table(report, c.out_console.width))
    c.console.print(f"[green]wrote[/] {output}  (serving.json, serving.md, serving.png; {choice.reason})",
                    highlight=False, soft_wrap=True)


serve_bench = c.handle_errors(c.with_options(serve_bench, c.ENGINE_OPTIONS, before=None))
