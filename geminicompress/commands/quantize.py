"""`geminicompress quantize`: one quantization stage; the methods come from the registry (runtime/methods.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.core.errors import InputError
from geminicompress.runtime.methods import METHODS

_METHOD_HELP = "; ".join(f"{name}: {m.help}" for name, m in METHODS.items())


# every method config's fields as options (the union; each option's help says which methods take it)
METHOD_OPTIONS = c.stage_options({", ".join(n for n, m in METHODS.items() if m.config is cls): cls
                                  for cls in dict.fromkeys(m.config for m in METHODS.values())},
                                 skip={"type", "method", "data", "allocation", "overrides"})


def quantize(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    method: str = typer.Option(..., "--method", "-m", help=f"{_METHOD_HELP}."),
    target_bits: Optional[float] = typer.Option(None, "--target-bits", help="gptq mixed precision: average stored bits per weight (scales included), e.g. 3.5, spent where the sensitivity table says it hurts least."),
    target_size_mb: Optional[float] = typer.Option(None, "--target-size-mb", help="gptq mixed precision: checkpoint size in MB (--gguf-type auto: the model.gguf file's)."),
    max_drift: Optional[str] = typer.Option(None, "--max-drift", help="gptq mixed precision: the smallest allocation whose predicted perplexity drift stays under this, e.g. 2%."),
    allocation_options: Optional[str] = typer.Option(None, "--allocation-options", help="Settings a module may get, comma separated (default gptq:b4g64,gptq:b3g64; --gguf-type auto: GGUF types gguf:Q2_K,...,gguf:Q8_0)."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="A sensitivity.json to allocate from (default: measure a proxy table on --data first, with the model in memory)."),
    **options: Any,
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
    given, run = c.split_options(options)
    stage = {"type": "quantize", "method": method, **given}
    allocation = allocation_stage(target_bits, target_size_mb, max_drift, allocation_options, sensitivity)
    if allocation:
        stage["allocation"] = allocation
    for key in stage:
        if key not in METHODS[method].config.model_fields:
            raise InputError(f"--{key.replace('_', '-')} does not apply to --method {method}")
    c.run_single_stage(model, stage, output, run, source="quantize options")


quantize = c.handle_errors(c.with_options(c.with_options(quantize, METHOD_OPTIONS, before="target_bits"),
                                          c.RUN_OPTIONS, before=None))


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
    return {k: v for k, v in given.items() if v is not None} or None
