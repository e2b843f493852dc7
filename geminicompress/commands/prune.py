"""`geminicompress prune`: magnitude (global or per layer), Wanda or SparseGPT, unstructured or N:M."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from geminicompress.commands import common as c
from geminicompress.compress.prune.config import PruneStage

PRUNE_OPTIONS = c.stage_options({"prune": PruneStage}, skip={"type", "data"})


def prune(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    **options: Any,
) -> None:
    """Prune MODEL's decoder linear layers and write a dense checkpoint with exact zeros (plus masks).

    \b
    Examples:
      geminicompress prune smollm2-demo -o out-pruned    # 40% global magnitude
      geminicompress prune smollm2-demo -o out-24 --method wanda --pattern 2:4
    """
    given, run = c.split_options(options)
    report = c.run_single_stage(model, {"type": "prune", **given}, output, run, source="prune options")
    if not run["quiet"]:
        c.out_console.print(sparsity_table(report["stages"][0]["result"]))


prune = c.handle_errors(c.with_options(prune, [*PRUNE_OPTIONS, *c.RUN_OPTIONS], before=None))


def sparsity_table(summary: dict):
    """Per-layer sparsity: one row per decoder layer, one column per linear (from report.json's rows)."""
    from rich.table import Table

    rows = summary["layers"]
    linears = list(dict.fromkeys(r["linear"] for r in rows))
    table = Table(title=f"{summary['method']} ({summary['pattern'] or summary['scope']}): "
                        f"{summary['achieved_sparsity']:.2%} of {summary['prunable_params']:,} weights pruned")
    table.add_column("layer", justify="right")
    for linear in linears:
        table.add_column(linear.rsplit(".", 1)[-1], justify="right")
    table.add_column("all", justify="right", style="bold")
    for layer in dict.fromkeys(r["layer"] for r in rows):
        mine = {r["linear"]: r for r in rows if r["layer"] == layer}
        cells = [_cell(mine[n]["sparsity"]) if n in mine else "-" for n in linears]
        overall = sum(r["zeros"] for r in mine.values()) / sum(r["params"] for r in mine.values())
        table.add_row(str(layer), *cells, f"{overall:.1%}")
    return table


def _cell(sparsity: float) -> str:
    text = f"{sparsity:.1%}"
    return f"[red]{text}[/]" if sparsity > 0.9 else text
