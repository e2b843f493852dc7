"""`geminicompress recipes`: list the bundled recipes (or print one to copy and edit)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from geminicompress.commands import common as c
from geminicompress.core.errors import InputError
from geminicompress.runtime.recipes.loader import bundled_recipes, read_yaml
from geminicompress.runtime.recipes.schema import stage_tag


@c.handle_errors
def recipes(name: Optional[str] = typer.Argument(None, help="Print this bundled recipe's YAML.")) -> None:
    """List the bundled recipes; `geminicompress recipes NAME > my.yaml` copies one to edit."""
    bundled = bundled_recipes()
    if name is not None:
        if name not in bundled:
            raise InputError(f"no bundled recipe '{name}' (bundled: {', '.join(bundled)})")
        typer.echo(bundled[name].read_text(), nl=False)
        return
    table = Table(title="bundled recipes (geminicompress run NAME -o OUT)")
    table.add_column("name", style="bold")
    table.add_column("stages")
    table.add_column("description")
    for key, path in bundled.items():
        data = read_yaml(path)
        stages = ", ".join(stage_tag(s) for s in data.get("stages", []))
        table.add_row(key, stages, str(data.get("description", "")))
    c.out_console.print(table)
