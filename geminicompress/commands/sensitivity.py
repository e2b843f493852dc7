"""`geminicompress sensitivity`: per-module drift of each candidate setting, as sensitivity.json + heat-map."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.compress.sensitivity.measure import MEASURES, measure_sensitivity, SensitivitySettings
from geminicompress.compress.sensitivity.options import parse_options
from geminicompress.compress.sensitivity.plot import write_heatmap
from geminicompress.compress.targets import decoder_linears as quantizable
from geminicompress.core.arch import arch_for
from geminicompress.data.windows import calibration_windows, vocab_of
from geminicompress.core.errors import InputError
from geminicompress.models.loading import load_model
from geminicompress.host.output import OutputDir, check_output_path, write_json
from geminicompress.runtime.recipes.inputs import model_inputs

DEFAULT_OPTIONS = "gptq:b4g64,gptq:b3g64"


def sensitivity(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    options: str = typer.Option(DEFAULT_OPTIONS, "--options", help="Candidate settings, comma separated: gptq:b4g64, "
                                "rtn:b3g128, magnitude:0.5 (or prune:0.5), wanda:0.5, sparsegpt:0.5."),
    measure: str = typer.Option("kl", "--measure", help="kl: KL at the model output per module and option; proxy: "
                                "layer output error x a per-depth propagation gain (one layer forward each, much "
                                "faster); both: both, and their rank correlation."),
    kl_windows: int = typer.Option(2, "--kl-windows", help="Calibration windows the drift is measured on (statistics use all)."),
    fuse: bool = typer.Option(False, "--fuse/--per-module", help="One unit per group of linears reading one input "
                              "(q/k/v, gate/up), as a serving engine fuses them."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Module name pattern (regex) left out; repeatable."),
    **run: Any,
) -> None:
    """Measure how much each decoder linear suffers from each candidate setting, applied to it alone.

    Example:

      geminicompress sensitivity smollm2-demo --data wiki.txt --options gptq:b4g64,gptq:b3g64 -o sens
    """
    parsed = parse_options(options)
    if measure not in MEASURES:
        raise InputError(f"--measure '{measure}' is not one of {', '.join(MEASURES)}")
    if kl_windows < 1:
        raise InputError(f"--kl-windows must be at least 1, got {kl_windows}")
    inputs = [*model_inputs("model", model), ("--data", run["data"])]
    check_output_path(output, run["force"], inputs)
    choice = c.use_threads(run["threads"])
    dev = c.parse_device(run["device"])
    progress = c.RichProgress(run["quiet"])
    loaded = load_model(model, trust_remote_code=run["trust_remote_code"], allow_pickle=run["allow_pickle"])
    keep = set(quantizable(loaded.model, arch_for(loaded.model), ignore or []))
    windows = calibration_windows(loaded.tokenizer, run["data"] or "builtin:pydoc", run["samples"] or 32,
                                  run["calib_seq_len"] or 512, run["seed"], run["text_column"], run["frame"], vocab_of(loaded.model))
    t0 = time.perf_counter()
    table = measure_sensitivity(loaded.model, windows, parsed, SensitivitySettings(keep=keep, kl_windows=kl_windows,
                                                                                   measure=measure, fuse=fuse,
                                                                                   device=dev, progress=progress,
                                                                                   seed=run["seed"]))
    table.update(model=model, data=run["data"] or "builtin:pydoc", seconds=round(time.perf_counter() - t0, 3),
                 threads=choice.threads)
    with OutputDir(output, run["force"], inputs=inputs) as tmp:
        write_json(tmp / "sensitivity.json", table)
        write_heatmap(table, tmp / "sensitivity.png")
    if "rank_correlation" in table:
        c.console.print(f"rank correlation proxy vs kl: {table['rank_correlation']}")
    c.console.print(f"[green]wrote[/] {output}  (sensitivity.json, sensitivity.png; {table['seconds']:.1f} s, "
                    f"{choice.reason})")


SAMPLES = typer.Option(None, "--samples", help="Calibration windows for statistics (default 32).")
sensitivity = c.handle_errors(c.with_options(sensitivity, c.calibrated_options(samples=SAMPLES), before=None))
