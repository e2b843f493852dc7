"""Output at 80 columns (a pipe, a CI log): every eval column kept, names and flags never cut (issue #16)."""

import re

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.eval.table import markdown_table, rich_table

runner = CliRunner()
COMMANDS = ["quantize", "prune", "distill", "eval", "run", "validate", "recipes"]


def model(name, base=False, ppl=14.92, ttft=364.0, tpot=66.0, tput=None, unreliable=False):
    return {"name": name, "baseline": base, "size_mb": 513.2 if base else 210.0, "params": 134_515_008,
            "peak_memory_mb": 824.0, "sparsity": 0.0 if base else 0.015,
            "quality": {"perplexity": ppl, "kl_to_baseline": 0.0 if base else 0.00687,
                        "top1_agreement": 1.0 if base else 0.954, "tokens": 8176, "windows": 16, "seq_len": 512},
            "latency": {"ttft_ms": {"median": ttft, "p90": ttft}, "tpot_ms": {"median": tpot, "p90": tpot},
                        "throughput_tok_s": tput or {"1": 13.2, "4": 32.4}, "load": {"unreliable": unreliable}}}


def report(*names):
    models = [model(names[0], base=True)]
    models += [model(n, ppl=15.02, ttft=207.0, tpot=40.0, tput={"1": 0.35, "4": 2.34}) for n in names[1:]]
    return {"data": "builtin:pydoc", "models": models, "machine": {"device": "cpu", "torch_threads": 1},
            "options": {"latency": True, "prompt_len": 128, "gen_len": 32, "repeats": 3}}


def render(rep, width):
    console = Console(width=width, record=True, color_system=None)
    console.print(rich_table(rep, width))
    return console.export_text()


HEADER_WORDS = ["ppl", "KL", "top-1", "TTFT", "TPOT", "tok/s", "peak", "size", "params", "spar"]


@pytest.mark.parametrize("names", [("smollm2-demo", "out-quickstart"),
                                   ("smollm2-demo", "out-gptq-4bit-g64-act-order", "out-awq-4bit-g64-clip")])
def test_narrow_table_keeps_every_column_and_whole_names(names):
    text = render(report(*names), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    for word in HEADER_WORDS:
        assert word in text, word
    for name in names:
        assert name in text  # never folded mid-word
    assert "134.5M" in text and "824" in text  # params and peak MB survive
    assert "0.35@1" in text and "2.3@4" in text and "13@1" in text  # below 1 tok/s keeps its digits


def test_wide_terminal_gets_one_table():
    text = render(report("smollm2-demo", "out-quickstart"), 160)
    assert text.count("model") == 1 and "quality and size" not in text


def test_very_long_names_are_listed_then_numbered():
    names = ("smollm2-demo", "a-very-long-model-directory-name-for-the-gptq-4bit-run-with-act-order")
    text = render(report(*names), 80)
    assert f"[2] {names[1]}" in text and max(len(line) for line in text.splitlines()) <= 80


def test_unreliable_timings_are_marked():
    rep = report("smollm2-demo", "out")
    rep["models"][1]["latency"]["load"]["unreliable"] = True
    rep["timing_warning"] = "timings unreliable for out (marked *): ..."
    md = markdown_table(rep)
    assert "| 207* (−43.1%) | 40* (−39.4%) | 0.35@1* 2.3@4* |" in md
    assert "unreliable timing" in render(rep, 80)


def _option_names(cmd_name):
    command = typer.main.get_command(app).commands[cmd_name]
    # a hidden option (a former name kept working for old scripts) is not listed, on purpose
    return [o for p in command.params if not getattr(p, "hidden", False)
            for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_at_80_columns_shows_every_flag_uncut(cmd):
    res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert "…" not in res.output
    for name in _option_names(cmd):
        assert re.search(rf"(^|[\s,/]){re.escape(name)}($|[\s,/\[])", res.output, re.M), name


def test_every_work_command_has_threads():
    for cmd in ("quantize", "prune", "distill", "eval", "run"):
        assert "--threads" in _option_names(cmd), cmd


def test_top_level_help_does_not_cut_summaries():
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    commands = res.output.split("Commands:")[1]
    assert res.exit_code == 0 and "..." not in commands and "…" not in commands
    assert all(cmd in commands for cmd in COMMANDS)
