"""`geminicompress tune`: allocate mixed precision under a drift budget, quantize, then evaluate the result.

tune = sensitivity (or a given table) -> knapsack for the smallest allocation whose predicted drift is under
--max-drift -> GPTQ with those per-module bits -> eval on --eval-data. OUT/allocation.json and
OUT/allocation_frontier.png hold the predicted drift-vs-bits curve of every budget, the chosen point,
and the measured drift next to it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from geminicompress.commands import common as c
from geminicompress.commands.quantize import parse_percent
from geminicompress.compress.gptq.allocate import ALLOCATION_FILE, FRONTIER_FILE
from geminicompress.compress.sensitivity.plot import write_frontier
from geminicompress.output import check_output_path
from geminicompress.pipeline import run_recipe
from geminicompress.recipes.loader import check_paths, validate


@c.handle_errors
def tune(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    max_drift: str = typer.Option(..., "--max-drift", help="Largest predicted perplexity drift, e.g. 2%."),
    options: str = typer.Option("gptq:b4g64,gptq:b3g64", "--options", help="Settings a module may get (gptq:b<bits>g<group>)."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="A sensitivity.json (default: measure a proxy table on --data)."),
    eval_data: str = typer.Option("builtin:pydoc", "--eval-data", help="Text the result is evaluated on (measured drift)."),
    eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", help="Evaluate at most this many tokens."),
    eval_seq_len: Optional[int] = typer.Option(None, "--eval-seq-len", help="Tokens per perplexity window."),
    format: str = typer.Option("gptq", "--format", help="gptq (dynamic overrides) or compressed-tensors (config groups)."),
    data: Optional[str] = c.DATA,
    text_column: str = c.TEXT_COLUMN,
    samples: Optional[int] = c.SAMPLES,
    calib_seq_len: Optional[int] = c.CAL_SEQ_LEN,
    seed: int = c.SEED,
    force: bool = c.FORCE,
    device: str = c.DEVICE,
    trust_remote_code: bool = c.TRUST,
    allow_pickle: bool = c.PICKLE,
    quiet: bool = c.QUIET,
) -> None:
    """Mixed-precision GPTQ at the smallest size whose predicted drift stays under --max-drift, then eval.

    Example:

      geminicompress tune smollm2-demo -o out-tuned --max-drift 5% --data wiki.txt --eval-data builtin:pydoc
    """
    allocation = {"max_drift": parse_percent(max_drift, "--max-drift"),
                  "options": [o.strip() for o in options.split(",") if o.strip()]}
    if sensitivity is not None:
        allocation["sensitivity"] = sensitivity
    quant = {"type": "quantize", "method": "gptq", "format": format, "allocation": allocation}
    first = re.fullmatch(r"gptq:b(\d+)g(-?\d+)", allocation["options"][0] if allocation["options"] else "")
    if first:  # the stage's own spec: the first option (every module gets one from the allocation)
        quant.update(bits=int(first.group(1)), group_size=int(first.group(2)))
    cal = c.calibration_options(data, text_column, samples, calib_seq_len)
    evaluation = {"type": "eval", "data": eval_data, "latency": False, "text_column": text_column,
                  **({"max_tokens": eval_tokens} if eval_tokens else {}), **({"seq_len": eval_seq_len} if eval_seq_len else {})}
    report = run_stages(model, [quant, evaluation], cal, output, force, device, trust_remote_code, allow_pickle,
                        seed, quiet)
    quality = report["stages"][1]["result"]["quality"]
    path = output / ALLOCATION_FILE
    chosen = json.loads(path.read_text())
    chosen.update(measured_drift_pct=round(100 * (quality["ppl_ratio"] - 1), 4), measured_on=eval_data,
                  measured_kl=quality.get("kl_to_baseline"))
    path.write_text(json.dumps(chosen, indent=2) + "\n")
    write_frontier(chosen, output / FRONTIER_FILE)
    c.out_console.print(f"average {chosen['average_bits']:.3f} bits per weight; drift predicted "
                        f"{chosen['predicted_drift_pct']:.2f}%, measured {chosen['measured_drift_pct']:.2f}% on {eval_data}")


def run_stages(model: str, stages: list[dict], cal: dict, out: Path, force: bool, device: Optional[str], trust: bool,
               allow_pickle: bool, seed: int, quiet: bool) -> dict:


    recipe = validate({"model": model, "seed": seed, "trust_remote_code": trust, "allow_pickle": allow_pickle,
                       "calibration": cal, "stages": stages}, "tune options")
    check_paths(recipe, "tune options")
    check_output_path(out, force)
    report = run_recipe(recipe, out, force=force, progress=c.RichProgress(quiet), device=c.parse_device(device),
                        command=sys.argv)
    c.console.print(f"[green]wrote[/] {out}  ({report['total_seconds']:.1f} s; details in {out / 'report.json'})")
    return report
