"""`geminicompress prune`: magnitude (global or per layer), Wanda or SparseGPT, unstructured or N:M."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geminicompress.commands import _common as c


@c.handle_errors
def prune(
    model: str = typer.Argument(..., help="MODEL: hub id, local directory, .gguf file, or smollm2-demo."),
    output: Path = c.OUT,
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Fraction of prunable weights set to zero, in [0, 1) (default 0.4)."),
    method: Optional[str] = typer.Option(None, "--method", help="magnitude (default), wanda or sparsegpt (the last two calibrate on --data)."),
    scope: Optional[str] = typer.Option(None, "--scope", help="global: one threshold over all layers (magnitude only, default); layer: the same sparsity in every layer."),
    pattern: Optional[str] = typer.Option(None, "--pattern", help="N:M semi-structured sparsity, e.g. 2:4 (implies --scope layer)."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Module name pattern (regex) never pruned; repeatable (default lm_head, embed_tokens)."),
    true_sequential: Optional[bool] = typer.Option(None, "--true-sequential/--no-true-sequential", help="wanda/sparsegpt: prune attention, then MLP, each from inputs through the already-pruned linears, in one pass per layer (default on)."),
    allocation: Optional[str] = typer.Option(None, "--allocation", help="How the total sparsity is split over the linears: uniform (= --scope layer), global (= --scope global), owl (outlier-weighted per layer) or sensitivity (knapsack over measured sensitivities; see --sensitivity)."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="--allocation sensitivity: a sensitivity.json from `geminicompress sensitivity` (default: measure one first)."),
    format: Optional[str] = typer.Option(None, "--format", help="dense (default; exact zeros) or compressed-tensors (sparse-bitmask, smaller on disk)."),
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
    """Prune MODEL's decoder linear layers and write a dense checkpoint with exact zeros (plus masks).

    \b
    Examples:
      geminicompress prune smollm2-demo -o out-pruned    # 40% global magnitude
      geminicompress prune smollm2-demo -o out-24 --method wanda --pattern 2:4
    """
    given = {"sparsity": sparsity, "method": method, "scope": scope, "pattern": pattern,
             "ignore": ignore or None, "true_sequential": true_sequential, "format": format,
             "allocation": allocation, "sensitivity": sensitivity}
    stage = {"type": "prune", **{k: v for k, v in given.items() if v is not None}}
    cal = c.calibration_options(data, text_column, samples, calib_seq_len)
    report = c.run_single_stage(model, stage, cal, output, force, device, trust_remote_code, allow_pickle, seed,
                                quiet, source="prune options", threads=threads, stream=stream, dtype=dtype,
                                verify=not no_verify)
    if not quiet:
        c.out_console.print(sparsity_table(report["stages"][0]["result"]))


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
