"""What every command shares: error handling (one line, exit code), the rich progress, common options."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import torch
import typer
from rich.console import Console
from typer.core import TyperCommand
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from geminicompress.host.diskerrors import disk_errno, disk_error
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.runtime.options import RunOptions
from geminicompress.runtime.pipeline import default_device, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage
from geminicompress.host.threads import apply_threads, choose_threads

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
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: partial output kept where resumable; rerun the same command")
            raise typer.Exit(130) from None
        except Exception as exc:
            if os.environ.get("GEMINICOMPRESS_DEBUG"):
                raise
            if not isinstance(exc, GeminiError) and disk_errno(exc) is not None:  # the user's disk, not our bug
                exc = disk_error(exc, "the output")
            if isinstance(exc, GeminiError):
                console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
                raise typer.Exit(exc.exit_code) from None
            # last resort: still one line, with the way to see more
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
    """`geminicompress.host.progress.Progress` drawn with rich bars on stderr."""
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
NONFINITE = typer.Option(False, "--allow-nonfinite", help="Go on when the input's weights hold NaN/Inf (by default "
                         "the command stops before any work, naming the tensor); report.json records what was found.")
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
FRAME = typer.Option("tokenizer", "--frame", help="How every window starts (calibration, training, evaluation, "
                     "prompts): tokenizer: as the model's tokenizer starts a text, with its BOS where it adds one "
                     "(Gemma, Llama 3, Mistral; SmolLM2 and Qwen add none); text: text tokens only, for text that "
                     "is not a document start.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bars or info lines.")
THREADS = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the cores not busy with other "
                       "processes when the command starts; see docs/eval.md).")


class PanelCommand(TyperCommand):
    """Click's plain help (never cuts an option name), its options grouped: those every method takes under
    "Options", then one section per `rich_help_panel` (a method's own), in the order they first appear."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            title = ("Arguments" if param.param_type_name == "argument" else
                getattr(param, "rich_help_panel", None) or "Options")
            sections.setdefault(title, []).append(record)
        for title, records in sections.items():
            with formatter.section(title):
                formatter.write_dl(records)


def use_threads(cli: Optional[int]):
    """Set torch's thread count before any work, for a command that runs no recipe: --threads, else the free
    cores (a recipe's run chooses its own: runtime/plan.py). Returns the `ThreadChoice`; its reason goes into
    the final `wrote` line."""
    choice = choose_threads(cli)
    apply_threads(choice.threads)
    return choice


def wrote_line(out: Path, seconds: float, threads: str) -> str:
    return f"[green]wrote[/] {out}  ({seconds:.1f} s, {threads}; details in {out / 'report.json'})"


def calibration_options(data: Optional[str], text_column: str, samples: Optional[int], seq_len: Optional[int]) -> dict:
    given = {"data": data, "samples": samples, "seq_len": seq_len}
    return {"text_column": text_column, **{k: v for k, v in given.items() if v is not None}}


def run_single_stage(model: str, stage: dict, out: Path, run: dict[str, Any], source: str) -> dict:
    """Build a one-stage recipe from options (`run`: the values of RUN_OPTIONS), run it, print where the
    output went."""
    cal = calibration_options(run["data"], run["text_column"], run["samples"], run["calib_seq_len"])
    top = {"output": {"dtype": run["dtype"]}} if run["dtype"] is not None else {}
    recipe = recipe_from_stage(model, stage, cal, source, seed=run["seed"], trust_remote_code=run["trust_remote_code"],
                               allow_pickle=run["allow_pickle"], allow_nonfinite=run["allow_nonfinite"],
                               frame=run["frame"], **top)
    report = run_recipe(recipe, out, RunOptions(
        force=run["force"], progress=RichProgress(run["quiet"]), device=parse_device(run["device"]),
        command=sys.argv, stream=run["stream"], verify=not run["no_verify"], threads=run["threads"] or "auto"))
    console.print(wrote_line(out, report["total_seconds"], report["threads_chosen"]), highlight=False, soft_wrap=True)
    return report


def stage_options(configs: dict[str, type], skip: set[str]) -> list[inspect.Parameter]:
    """One Typer option per field of the stage `configs` ({owner names: config class}) not in `skip`: named
    --field-name (a bool: --field/--no-field, or the `cli` names its Field gives in json_schema_extra), its help
    the field's description (per owner when they differ), default None (the stage's own default applies), in a
    --help panel of its owners' names unless every owner takes it. Adding an option to a method is then one field in its config: the commands read them from there."""
    fields: dict[str, list[tuple[str, Any]]] = {}
    for owners, cls in configs.items():
        for name, field in cls.model_fields.items():
            if name not in skip:
                fields.setdefault(name, []).append((owners, field))
    params = []
    for name, found in fields.items():
        field = found[0][1]
        dash = name.replace("_", "-")
        kind = _option_type(field.annotation)
        cli = (field.json_schema_extra or {}).get("cli") or (f"--{dash}/--no-{dash}" if kind is bool else f"--{dash}")
        helps: dict[str, list[str]] = {}
        for owners, f in found:
            helps.setdefault(f.description or "", []).append(owners)
        # the panel names the owners; the help does too only where they describe the option differently
        text = "; ".join(f"{', '.join(o)}: {d}" if len(helps) > 1 else d for d, o in helps.items())
        text = text if len(helps) > 1 else text[:1].upper() + text[1:]
        # --help groups what only some methods take in a panel of theirs, after the options every method takes
        panel = None if len(found) == len(configs) else f"Options of {', '.join(o for o, _ in found)}"
        option = typer.Option(None, cli, help=text + ("." if text and text[-1] not in ".)" else ""),
                              rich_help_panel=panel)
        params.append(_keyword(name, Optional[List[str]] if kind is list else Optional[kind], option))
    return params


def _option_type(annotation: Any) -> type:
    """The Typer type of a field: bool, int, float, list (of str), else str (Literals, "auto"|int, paths)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if annotation is bool or args == [bool]:
        return bool
    if typing.get_origin(annotation) is list or any(typing.get_origin(a) is list for a in args):
        return list
    if typing.get_origin(annotation) is typing.Literal and all(
            isinstance(v, int) and not isinstance(v, bool) for v in typing.get_args(annotation)):
        return int
    for t in (int, float):
        if args == [t]:
            return t
    return str


def with_options(func: Callable[..., Any], options: list[inspect.Parameter], before: str | None) -> Callable[..., Any]:
    """`func` (taking **options) with `options` in its signature, before its parameter `before` (None: last):
    Typer reads them from there, and `func` receives their values as keyword arguments."""
    sig = inspect.signature(func)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next((i for i, p in enumerate(fixed) if p.name == before), len(fixed))
    fixed = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if i >= at else p for i, p in enumerate(fixed)]
    params = [*fixed[:at], *options, *fixed[at:]]
    hints = typing.get_type_hints(func)

    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {**{k: v for k, v in hints.items() if k != "options"},
                               **{p.name: p.annotation for p in options}}
    del command.__wrapped__
    return command


def _keyword(name: str, annotation: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


# the options of a command that runs one stage on a model (quantize, prune, distill), in --help's order
RUN_OPTIONS = [_keyword("data", Optional[str], DATA), _keyword("text_column", str, TEXT_COLUMN),
               _keyword("samples", Optional[int], SAMPLES), _keyword("calib_seq_len", Optional[int], CAL_SEQ_LEN),
               _keyword("seed", int, SEED), _keyword("frame", str, FRAME), _keyword("force", bool, FORCE),
               _keyword("device", str, DEVICE),
               _keyword("trust_remote_code", bool, TRUST), _keyword("allow_pickle", bool, PICKLE),
               _keyword("allow_nonfinite", bool, NONFINITE),
               _keyword("stream", Optional[bool], STREAM), _keyword("dtype", Optional[str], DTYPE),
               _keyword("no_verify", bool, NO_VERIFY), _keyword("quiet", bool, QUIET),
               _keyword("threads", Optional[int], THREADS)]
RUN_DEFAULTS = {p.name: p.default.default for p in RUN_OPTIONS}  # what a command that leaves one out runs with
# the options of a command that calibrates on a model but writes no checkpoint through a recipe (sensitivity, tune)
CALIBRATED = ("data", "text_column", "samples", "calib_seq_len", "seed", "frame", "force", "device",
              "trust_remote_code", "allow_pickle", "quiet", "threads")
LLAMA_PYTHON = typer.Option(None, "--llama-python", help="Python that has llama-cpp-python (default: this one if it "
                            "imports llama_cpp, else $GEMINICOMPRESS_LLAMA_PYTHON).")
VLLM_PYTHON = typer.Option(None, "--vllm-python", help="Python of the venv that has vLLM (default: this one if it "
                           "imports vllm, else $GEMINICOMPRESS_VLLM_PYTHON).")
# the options of a command that runs models through an engine (eval, serve-bench)
ENGINE_OPTIONS = [_keyword("llama_python", Optional[str], LLAMA_PYTHON),
                  _keyword("vllm_python", Optional[str], VLLM_PYTHON),
                  *(p for p in RUN_OPTIONS if p.name in ("text_column", "frame", "force", "trust_remote_code", "quiet",
                                                         "threads"))]


def calibrated_options(**own: Any) -> list[inspect.Parameter]:
    """RUN_OPTIONS' calibration and run options (CALIBRATED), a command's `own` typer.Option in place of the
    common one of that name (its own help or default)."""
    return [p.replace(default=own[p.name]) if p.name in own else p for p in RUN_OPTIONS if p.name in CALIBRATED]


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the stage's options that were given, every RUN_OPTIONS value) of a command's **options."""
    run = {k: v for k, v in options.items() if k in RUN_DEFAULTS}
    return {k: v for k, v in options.items() if k not in RUN_DEFAULTS and v is not None and v != []}, run
