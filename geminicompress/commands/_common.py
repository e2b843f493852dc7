"""What every command shares: error handling (one line, exit code), the rich progress, common options."""

from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from geminicompress.errors import GeminiError

console = Console(stderr=True)
out_console = Console()


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn project errors into one red line and their exit code; never show a traceback
    unless GEMINICOMPRESS_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except GeminiError as exc:
            if os.environ.get("GEMINICOMPRESS_DEBUG"):
                raise
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: partial output kept where resumable; rerun the same command")
            raise typer.Exit(130) from None
        except Exception as exc:  # last resort: still one line, with the way to see more
            if os.environ.get("GEMINICOMPRESS_DEBUG"):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            console.print(
                f"[bold red]internal error:[/] {type(exc).__name__}: {first} "
                "(rerun with GEMINICOMPRESS_DEBUG=1 for the traceback, and please report it)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper


class _RichTask:
    def __init__(self, bar: Progress, task_id: Any) -> None:
        self.bar, self.task_id = bar, task_id

    def advance(self, n: int = 1, **fields: object) -> None:
        info = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self.bar.update(self.task_id, advance=n, info=info)


class RichProgress:
    """`geminicompress.progress.Progress` drawn with rich bars on stderr."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[_RichTask]:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
        with Progress(*columns, console=console, transient=False, disable=self.quiet) as bar:
            yield _RichTask(bar, bar.add_task(description, total=total, info=""))

    def info(self, message: str) -> None:
        if not self.quiet:
            console.print(f"[dim]{message}[/]", highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)  # one line, never cut


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    for noisy in ("transformers", "accelerate", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hub_logging.disable_propagation()  # it has its own handler: propagating printed each line twice

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def parse_device(device: Optional[str]):
    import torch

    from geminicompress.errors import InputError
    from geminicompress.pipeline import default_device

    if device in (None, "auto"):
        return default_device()
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"--device '{device}' is not a device (use auto, cpu, cuda, cuda:1)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but no CUDA GPU is visible")
    return dev


# Shared option declarations (Typer reads them from defaults).
OUT = typer.Option(..., "--output", "-o", help="Output directory (written atomically; must not exist unless --force).")
FORCE = typer.Option(False, "--force", help="Replace OUT if it already exists.")
DEVICE = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N.")
TRUST = typer.Option(False, "--trust-remote-code", help="Allow the model repository's own Python code to run.")
PICKLE = typer.Option(False, "--allow-pickle", help="Allow pickled *.bin/*.pt weights (they can run code).")
DATA = typer.Option(None, "--data", help="Calibration text: a .txt/.jsonl/.json/.csv/.parquet file, "
                    "a hub dataset name:config:split, or builtin:pydoc (offline, the default).")
TEXT_COLUMN = typer.Option("text", "--text-column", help="Column holding the text in structured DATA files.")
SAMPLES = typer.Option(None, "--samples", help="Calibration windows (default 128).")
CAL_SEQ_LEN = typer.Option(None, "--calib-seq-len", help="Tokens per calibration window (default 512).")
SEED = typer.Option(0, "--seed", help="Seed for calibration sampling and training.")
STREAM = typer.Option(None, "--stream/--no-stream", help="Read, process and write one decoder layer at a time, "
                      "so memory follows one layer, not the model (default: when the model's float32 weights "
                      "exceed half the available memory and every stage can stream).")
DTYPE = typer.Option(None, "--dtype", help="Float dtype of the written weights: float32, bfloat16, float16 "
                     "(default: float32 in memory; the input's own dtype when streaming).")
NO_VERIFY = typer.Option(False, "--no-verify", help="Skip the check of OUT after writing it: by default OUT is loaded "
                         "back (in memory, or one layer at a time when it is big) and its logits on 2 x 64 probe "
                         "tokens are compared with the in-process model's; the run fails, keeping nothing, when "
                         "they differ. The check costs one load of OUT plus a 128-token forward (a second pass "
                         "over the layers read from disk for a streamed run).")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bars or info lines.")
THREADS = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the cores not busy with other "
                       "processes when the command starts; see docs/eval.md).")


def use_threads(cli: Optional[int], recipe: Optional[int]):
    """Set torch's thread count before any work: --threads, else the recipe's, else the free cores.
    Returns the `ThreadChoice`; its reason goes into the final `wrote` line."""
    from geminicompress.threads import apply_threads, choose_threads

    choice = choose_threads(cli, recipe)
    apply_threads(choice.threads)
    return choice


def wrote_line(out: Path, seconds: float, threads) -> str:
    return f"[green]wrote[/] {out}  ({seconds:.1f} s, {threads.reason}; details in {out / 'report.json'})"


def calibration_options(data: Optional[str], text_column: str, samples: Optional[int], seq_len: Optional[int]) -> dict:
    cal: dict[str, Any] = {"text_column": text_column}
    if data is not None:
        cal["data"] = data
    if samples is not None:
        cal["samples"] = samples
    if seq_len is not None:
        cal["seq_len"] = seq_len
    return cal


def run_single_stage(model: str, stage: dict, cal: dict, out: Path, force: bool, device: Optional[str],
                     trust: bool, allow_pickle: bool, seed: int, quiet: bool, source: str,
                     threads: Optional[int] = None, stream: Optional[bool] = None,
                     dtype: Optional[str] = None, verify: bool = True) -> dict:
    """Build a one-stage recipe from options, run it, print where the output went."""
    import sys

    from geminicompress.output import check_output_path
    from geminicompress.pipeline import run_recipe
    from geminicompress.recipes.loader import recipe_from_stage

    top = {"output": {"dtype": dtype}} if dtype is not None else {}
    recipe = recipe_from_stage(model, stage, cal, source, seed=seed, trust_remote_code=trust, allow_pickle=allow_pickle, **top)
    check_output_path(out, force)
    dev = parse_device(device)
    choice = use_threads(threads, recipe.threads)
    report = run_recipe(recipe, out, force=force, progress=RichProgress(quiet), device=dev, command=sys.argv, stream=stream,
                        verify=verify)
    console.print(wrote_line(out, report["total_seconds"], choice), highlight=False, soft_wrap=True)
    return report
