"""`geminicompress tune`: mixed-precision GPTQ whose measured drift stays under --max-drift (tune.py: rounds of
allocate -> quantize -> eval, each re-allocating with the undercount the last one measured). OUT/allocation.json
and OUT/allocation_frontier.png hold the predicted drift-vs-bits curve, the chosen point, the measured drift
and every round.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.commands.quantize import parse_percent
from geminicompress.compress.gptq.allocate import ALLOCATION_FILE
from geminicompress.eval.api import baseline_kept
from geminicompress.host.output import check_output_path
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.inputs import model_inputs
from geminicompress.runtime.recipes.loader import validate
from geminicompress.runtime.tune import run_tune


def tune(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    max_drift: str = typer.Option(..., "--max-drift", help="Largest perplexity drift measured on --eval-data, e.g. 5%."),
    options: str = typer.Option("gptq:b4g64,gptq:b3g64", "--options", help="Settings a module may get (gptq:b<bits>g<group>)."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="A sensitivity.json (default: measure a proxy table on --data)."),
    eval_data: str = typer.Option("builtin:pydoc", "--eval-data", help="Text the result is evaluated on (measured drift)."),
    eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", help="Evaluate at most this many tokens."),
    eval_seq_len: Optional[int] = typer.Option(None, "--eval-seq-len", help="Tokens per perplexity window."),
    format: str = typer.Option("gptq", "--format", help="gptq (dynamic overrides) or compressed-tensors (config groups)."),
    **run: Any,
) -> None:
    """Mixed-precision GPTQ whose measured drift on --eval-data stays under --max-drift, in as few bits as found.

    Each round allocates under a predicted budget, quantizes and measures; while the measured drift is over
    --max-drift, the next round divides the budget by the undercount the last one measured (at most 4 rounds).

    \b
    Example:
      geminicompress tune smollm2-demo -o out-tuned --max-drift 5% --data wiki.txt --eval-data builtin:pydoc \\
          --options gptq:b8g64,gptq:b4g64,gptq:b3g64
    """
    budget = parse_percent(max_drift, "--max-drift")
    opts = [o.strip() for o in options.split(",") if o.strip()]
    first = re.fullmatch(r"gptq:b(\d+)g(-?\d+)", opts[0] if opts else "")
    cal = c.calibration_options(run["data"], run["text_column"], run["samples"], run["calib_seq_len"])
    evaluation = {"type": "eval", "data": eval_data, "latency": False, "text_column": run["text_column"],
                  **({"max_tokens": eval_tokens} if eval_tokens else {}), **({"seq_len": eval_seq_len} if eval_seq_len else {})}
    base = {"model": model, "seed": run["seed"], "frame": run["frame"], "calibration": cal,
            "trust_remote_code": run["trust_remote_code"], "allow_pickle": run["allow_pickle"]}
    inputs = [*model_inputs("model", model), ("--data", run["data"]), ("--sensitivity", sensitivity),
              ("--eval-data", eval_data)]
    # what a link OUT points to: the rounds' folder moves there
    target = check_output_path(output, run["force"], inputs)
    choice = c.use_threads(run["threads"])
    progress = c.RichProgress(run["quiet"])
    dev = c.parse_device(run["device"])

    def run_round(asked: float, table: Optional[str], folder: Path) -> tuple[dict, dict]:
        allocation = {"max_drift": asked, "options": opts, **({"sensitivity": table} if table else {})}
        quant = {"type": "quantize", "method": "gptq", "format": format, "allocation": allocation}
        if first:  # the stage's own spec: the first option (every module gets one from the allocation)
            quant.update(bits=int(first.group(1)), group_size=int(first.group(2)))
        recipe = validate({**base, "stages": [quant, evaluation]}, "tune options")
        report = run_recipe(recipe, folder, RunOptions(force=True, progress=progress, device=dev, command=sys.argv))
        return report, json.loads((folder / ALLOCATION_FILE).read_text())

    with baseline_kept():  # the input model's figures measured in round 1, reused by the later rounds
        chosen = run_tune(run_round, target, budget, opts, sensitivity,
                          lambda line: c.console.print(line, highlight=False), measured_on=eval_data)
    c.out_console.print(f"wrote {output}: round {chosen['round']} of {len(chosen['rounds'])}, "
                        f"{chosen['average_bits']:.3f} bits per weight; drift predicted "
                        f"{chosen['predicted_drift_pct']:.2f}%, measured {chosen['measured_drift_pct']:.2f}% on "
                        f"{eval_data} (budget {budget:g}%; {choice.reason})")


tune = c.handle_errors(c.with_options(tune, c.calibrated_options(), before=None))
