"""`geminicompress eval`: quality drift vs latency gain of models against a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geminicompress.commands import _common as c
from geminicompress.errors import NotAvailableError


@c.handle_errors
def eval_(
    models: List[str] = typer.Argument(..., help="Models to compare (any format geminicompress writes)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Reference MODEL (default: the first MODEL)."),
    data: str = typer.Option("builtin:pydoc", "--data", help="Evaluation text (file, hub dataset, builtin:pydoc)."),
    output: Path = typer.Option(..., "--output", "-o", help="Report directory (report.json, report.md, tradeoff.png)."),
) -> None:
    """Compare models on the same text and machine: perplexity, KL, agreement, latency, memory, size."""
    try:
        from geminicompress.eval import api  # noqa: F401
    except ModuleNotFoundError as exc:
        raise NotAvailableError("eval is not implemented in this version of geminicompress yet") from exc
