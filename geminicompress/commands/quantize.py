"""`geminicompress quantize`: one quantization stage; the methods come from the registry (methods.py)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geminicompress.commands import _common as c
from geminicompress.errors import InputError
from geminicompress.methods import METHODS

_METHOD_HELP = "; ".join(f"{name}: {m.help}" for name, m in METHODS.items())


@c.handle_errors
def quantize(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    method: str = typer.Option(..., "--method", "-m", help=f"{_METHOD_HELP}."),
    bits: Optional[int] = typer.Option(None, "--bits", help="Weight bits: 8 for int8/w8a8; 2, 3, 4 or 8 for gptq/awq (default 4)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="gptq/awq/rtn: input columns sharing a scale; -1 or 0 = per output channel. Default auto: the largest of 128, 64, 32 dividing every quantized layer's input features (printed, and recorded in report.json)."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="gptq, rtn: symmetric (default) or asymmetric with zero points."),
    zero_point: Optional[bool] = typer.Option(None, "--zero-point/--no-zero-point", help="awq: asymmetric with zero points (default) or symmetric."),
    act_order: Optional[str] = typer.Option(None, "--act-order", help="gptq: none | static | group. static (default): columns by decreasing Hessian diagonal, groups fixed as j // group-size (every loader, vLLM included); group: groups formed in that order, g_idx stored (vLLM refuses it); none: stored order."),
    no_act_order: bool = typer.Option(False, "--no-act-order", hidden=True, help="= --act-order none"),
    true_sequential: Optional[bool] = typer.Option(None, "--true-sequential/--no-true-sequential", help="gptq: quantize attention before MLP inside each layer (default on)."),
    one_pass: Optional[bool] = typer.Option(None, "--one-pass/--multi-pass", help="gptq true-sequential: one pass over the windows per layer (default; holds a layer's activations for every window) or one pass per group of linears (less memory, slower)."),
    damp: Optional[float] = typer.Option(None, "--damp", help="gptq: dampening as a fraction of the mean Hessian diagonal (default 0.01)."),
    first_token_weight: Optional[float] = typer.Option(None, "--first-token-weight", help="gptq: weight of each calibration window's first token (the attention sink) in the Hessians (default 16; 1 = every token alike)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="gptq: columns per lazy-update block (default 128)."),
    keep_zeros: Optional[bool] = typer.Option(None, "--keep-zeros/--no-keep-zeros", help="gptq, awq+gptq on a pruned model: keep its zeros exactly (default off: GPTQ's error feedback moves some off zero, which fits better; on the demo 68.2 vs 72.9 perplexity after SparseGPT 50%). For a sparsity pattern a later tool needs."),
    calib_dtype: Optional[str] = typer.Option(None, "--calib-dtype", help="gptq: float32 (default) or bfloat16: the dtype layers compute in while calibrating; the solver and the saved weights stay float32. bfloat16 is faster on GPUs and on CPUs with AVX512-BF16."),
    smoothquant_alpha: Optional[float] = typer.Option(None, "--smoothquant-alpha", help="w8a8: SmoothQuant strength in [0, 1], calibrated on --data."),
    clip: Optional[bool] = typer.Option(None, "--clip/--no-clip", help="awq: search a clipping range per group (default on)."),
    n_grid: Optional[int] = typer.Option(None, "--n-grid", help="awq: points in the alpha grid (default 20)."),
    search_results: Optional[str] = typer.Option(None, "--search-results", help="awq: re-apply saved scales/clips (awq_search.safetensors) instead of searching."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Module name pattern (regex) to keep in float; repeatable (default lm_head)."),
    target_bits: Optional[float] = typer.Option(None, "--target-bits", help="gptq mixed precision: average stored bits per weight (scales included), e.g. 3.5, spent where the sensitivity table says it hurts least."),
    target_size_mb: Optional[float] = typer.Option(None, "--target-size-mb", help="gptq mixed precision: checkpoint size in MB."),
    max_drift: Optional[str] = typer.Option(None, "--max-drift", help="gptq mixed precision: the smallest allocation whose predicted perplexity drift stays under this, e.g. 2%."),
    allocation_options: Optional[str] = typer.Option(None, "--allocation-options", help="Settings a module may get, comma separated (default gptq:b4g64,gptq:b3g64)."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="A sensitivity.json to allocate from (default: measure a proxy table on --data first)."),
    format: Optional[str] = typer.Option(None, "--format", help="On-disk format: gptq | awq | compressed-tensors | dense (default: the method's own)."),
    data: Optional[str] = c.DATA,
    text_column: str = c.TEXT_COLUMN,
    samples: Optional[int] = c.SAMPLES,
    calib_seq_len: Optional[int] = c.CAL_SEQ_LEN,
    seed: int = c.SEED,
    force: bool = c.FORCE,
    device: str = c.DEVICE,
    trust_remote_code: bool = c.TRUST,
    allow_pickle: bool = c.PICKLE,
    stream: Optional[bool] = c.STREAM,
    dtype: Optional[str] = c.DTYPE,
    no_verify: bool = c.NO_VERIFY,
    quiet: bool = c.QUIET,
    threads: Optional[int] = c.THREADS,
) -> None:
    """Quantize MODEL's linear layers and write a checkpoint transformers/vLLM load.

    \b
    Examples:
      geminicompress quantize smollm2-demo -o out-w8a8 --method w8a8
      geminicompress quantize smollm2-demo -o out-rtn --method rtn --bits 4
      geminicompress quantize HuggingFaceTB/SmolLM2-135M -o out-gptq \\
          --method gptq --bits 4 --group-size 64 --data wiki.txt
    """
    if method not in METHODS:
        raise InputError(f"--method '{method}' is not one of {', '.join(METHODS)}")
    given = {
        "bits": bits, "group_size": group_size, "sym": sym, "zero_point": zero_point, "act_order": "none" if no_act_order else act_order,
        "true_sequential": true_sequential, "one_pass": one_pass, "damp": damp, "first_token_weight": first_token_weight, "block_size": block_size,
        "calib_dtype": calib_dtype, "keep_zeros": keep_zeros,
        "smoothquant_alpha": smoothquant_alpha, "clip": clip, "n_grid": n_grid, "search_results": search_results,
        "ignore": ignore or None, "format": format,
    }
    stage = {"type": "quantize", "method": method, **{k: v for k, v in given.items() if v is not None}}
    allocation = allocation_stage(target_bits, target_size_mb, max_drift, allocation_options, sensitivity)
    if allocation:
        stage["allocation"] = allocation
    _check_applicable(method, stage)
    cal = c.calibration_options(data, text_column, samples, calib_seq_len)
    c.run_single_stage(model, stage, cal, output, force, device, trust_remote_code, allow_pickle, seed, quiet,
                       source="quantize options", threads=threads, stream=stream, dtype=dtype,
                       verify=not no_verify)


def parse_percent(text: str, option: str) -> float:
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        value = -1.0
    if value <= 0:
        raise InputError(f"{option} must be a positive percentage such as 2% (got '{text}')")
    return value


def allocation_stage(target_bits: float | None, target_size_mb: float | None, max_drift: str | None,
                     options: str | None, sensitivity: str | None) -> dict | None:
    """The stage's `allocation:` mapping from the mixed-precision options (None when none is given)."""
    given = {"target_bits": target_bits, "target_size_mb": target_size_mb,
             "max_drift": parse_percent(max_drift, "--max-drift") if max_drift is not None else None,
             "options": [o.strip() for o in options.split(",") if o.strip()] if options is not None else None,
             "sensitivity": sensitivity}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def _check_applicable(method: str, stage: dict) -> None:
    cls = METHODS[method].config
    for key in stage:
        if key not in cls.model_fields:
            raise InputError(f"--{key.replace('_', '-')} does not apply to --method {method}")
