"""`geminicompress validate`: check a recipe without loading a model; `--schema` prints its JSON Schema."""

from __future__ import annotations

from typing import List, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.core.errors import InputError
from geminicompress.runtime.recipes.loader import json_schema, load_recipe
from geminicompress.runtime.recipes.schema import stage_tag


@c.handle_errors
def validate(
    recipe: Optional[str] = typer.Argument(None, help="Recipe YAML file or bundled recipe name."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a key before validating, as in `run`."),
    schema: bool = typer.Option(False, "--schema", help="Print the recipe JSON Schema (for editors) and exit."),
) -> None:
    """Check RECIPE: keys, types, ranges, and that its files exist. Exit 2 with one line if not."""
    if schema:
        typer.echo(json_schema())
        return
    if recipe is None:
        raise InputError("give a RECIPE to validate, or --schema")
    parsed, path = load_recipe(recipe, set_ or [])
    stages = ", ".join(stage_tag(s) for s in parsed.stages)
    c.out_console.print(f"[green]ok[/] {path}: model {parsed.model}; stages: {stages}", highlight=False)
