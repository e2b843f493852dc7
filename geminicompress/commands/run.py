"""`geminicompress run`: run a recipe (a YAML file or a bundled recipe's name)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.eval.table import rich_table
from geminicompress.runtime.options import RunOptions
from geminicompress.runtime.pipeline import run_recipe
from geminicompress.runtime.recipes.loader import load_recipe


@c.handle_errors
def run(
    recipe: str = typer.Argument(..., help="Recipe YAML file, or the name of a bundled recipe (see `geminicompress recipes`)."),
    output: Path = c.OUT,
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key, e.g. --set stages.0.bits=3 (repeatable)."),
    force: bool = c.FORCE,
    device: str = c.DEVICE,
    no_verify: bool = c.NO_VERIFY,
    quiet: bool = c.QUIET,
    threads: Optional[int] = c.THREADS,
    stream: Optional[bool] = c.STREAM,
) -> None:
    """Run every stage of RECIPE on its model and write OUT (model, report.json, recipe.yaml).

    \b
    Example:
      geminicompress run quickstart -o out-quickstart
    """
    parsed, path = load_recipe(recipe, set_ or [])
    report = run_recipe(parsed, output, RunOptions(
        force=force, progress=c.RichProgress(quiet), device=c.parse_device(device), command=sys.argv, stream=stream,
        verify=not no_verify, threads=threads or "auto", recipe_file=path))
    c.console.print(c.wrote_line(output, report["total_seconds"], report["threads_chosen"]), highlight=False,
                    soft_wrap=True)
    _print_eval_tables(report, output)


def _print_eval_tables(report: dict, output: Path) -> None:
    """After a recipe with an eval stage, show its table (read back from OUT/<report>)."""
    for stage in report["stages"]:
        if stage["stage"] == "eval" and isinstance(stage.get("result"), dict) and stage["result"].get("report"):
            report_file = output / stage["result"]["report"]
            c.out_console.print(rich_table(json.loads(report_file.read_text()), c.out_console.width))
