"""One row per model with deltas against the baseline, as a rich table (terminal) or markdown.

Built from the report dict alone (report.json), so any command can re-render a finished report.
Deltas are relative changes, `+1.8%` / `−34%` (a true minus sign); KL and agreement are absolute.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

MINUS = "\u2212"
COLUMNS = ("model", "ppl", "KL", "top-1", "TTFT ms", "TPOT ms", "tok/s@batch", "peak MB", "size MB", "params", "sparsity")
_HEADERS = ("model", "ppl", "KL", "top-1", "TTFT\nms", "TPOT\nms", "tok/s\n@batch", "peak\nMB", "size\nMB", "params",
            "spar-\nsity")  # two-line headers keep the table within 80 columns


def pct_change(value: float | None, base: float | None) -> float | None:
    """Relative change of value against base, in percent."""
    if value is None or base is None or base == 0:
        return None
    return (value / base - 1.0) * 100.0


def fmt_delta(value: float | None, base: float | None) -> str:
    d = pct_change(value, base)
    if d is None:
        return ""
    sign = "+" if d >= 0 else MINUS
    return f"{sign}{abs(d):.0f}%" if abs(d) >= 100 else f"{sign}{abs(d):.1f}%"


def _num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:,.0f}"


def _with_delta(x: float | None, base: float | None, is_base: bool, digits: int = 4) -> tuple[str, str]:
    return _num(x, digits), ("" if is_base else fmt_delta(x, base))


def _get(d: dict | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _params(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


Cell = tuple[str, str]  # (value, delta against the baseline or "")
UNRELIABLE = "*"  # after a timing taken on a busy machine or from runs that disagree


def _rate(v: float) -> str:
    """Tokens per second: whole numbers from 10 up, one decimal below, two significant digits below 1."""
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _marked(cell: Cell, mark: str) -> Cell:
    value, delta = cell
    return (value + mark if mark and value != "n/a" else value), delta


def describe_timing(models: list[dict]) -> str | None:
    """`timings unreliable for A, B (marked *): why; fix` from the models' latency `load` verdicts: one line
    naming the models whose timings are suspect, why, and what to do; None when there are none."""
    bad = [(m["name"], m["latency"]["load"]) for m in models
           if (m.get("latency") or {}).get("load", {}).get("unreliable")]
    if not bad:
        return None
    worst = max((load for _, load in bad), key=lambda load: load.get("other_cores") or 0.0)
    names = ", ".join(name for name, _ in bad)
    return f"timings unreliable for {names} (marked {UNRELIABLE}): {worst['why']}; {worst['fix']}"


def rows(report: dict) -> list[list[Cell]]:
    """Cells of the table: one row per model, baseline first."""
    models = report["models"]
    base = next((m for m in models if m.get("baseline")), models[0])
    out = []
    for m in models:
        is_base = m is base
        q, lat = m.get("quality") or {}, m.get("latency") or {}
        tput = lat.get("throughput_tok_s") or {}
        kl, agree = q.get("kl_to_baseline"), q.get("top1_agreement")
        sp = m.get("sparsity")
        mark = UNRELIABLE if _get(lat, "load", "unreliable") else ""
        out.append([
            (m["name"], "(baseline)" if is_base else "(failed)" if m.get("error") else kernel_label(m)),
            _with_delta(q.get("perplexity"), _get(base, "quality", "perplexity"), is_base),
            ("n/a" if kl is None else f"{kl:.3g}", ""),
            ("n/a" if agree is None else f"{agree * 100:.1f}%", ""),
            _marked(_with_delta(_get(lat, "ttft_ms", "median"), _get(base, "latency", "ttft_ms", "median"), is_base, 3), mark),
            _marked(_with_delta(_get(lat, "tpot_ms", "median"), _get(base, "latency", "tpot_ms", "median"), is_base, 3), mark),
            ("\n".join(f"{_rate(v)}@{b}{mark}" for b, v in tput.items()) or "n/a", ""),
            (_num(m.get("peak_memory_mb"), 4), ""),
            _with_delta(m.get("size_mb"), base.get("size_mb"), is_base, 4),
            (_params(m.get("params")), ""),
            ("n/a" if sp is None else f"{sp * 100:.1f}%", ""),
        ])
    return out


_KERNELS = {"torch-int4-cpu": "int4", "torch-int4-cuda": "int4", "fbgemm-dynamic": "w8a8 fbgemm",
            "fbgemm-fp16-codes": "int8 fbgemm", "reference": "no fast kernel", "dense": "dense", "vllm": "vLLM",
            "dense-dequantized": "no 8-bit kernel, dequantized once"}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def kernel_label(model: dict) -> str:
    """`int4, bf16`: the kernel that ran the model's linears and the activation dtype (eval/engines/torch_kernels.py)."""
    k = model.get("kernel") or {}
    if not k:
        return ""
    return f"{_KERNELS.get(k['kernel'], k['kernel'])}, {_DTYPES.get(k['activation_dtype'], k['activation_dtype'])}"


def same_dtype_lines(report: dict) -> list[str]:
    """`gptq: TPOT 0.55x, TTFT 1.21x smollm2-demo @bfloat16's`: speed against the baseline timed in the
    same activation dtype (the int4 kernels compute in bf16; api.py adds that row)."""
    refs = {m["dtype"]: m for m in report["models"] if m.get("dtype_baseline") and m.get("latency")}
    lines = []
    for m in report["models"]:
        ref = refs.get(m.get("dtype"))
        if ref is None or m is ref or m.get("baseline") or not m.get("latency"):
            continue
        ratios = [f"{what} {_get(m, 'latency', key, 'median') / _get(ref, 'latency', key, 'median'):.2f}x"
                  for what, key in (("TPOT", "tpot_ms"), ("TTFT", "ttft_ms"))
                  if _get(m, "latency", key, "median") and _get(ref, "latency", key, "median")]
        if ratios:
            lines.append(f"{m['name']}: {', '.join(ratios)} {ref['name']}'s (same activation dtype)")
    return lines


def llama_lines(report: dict) -> list[str]:
    """`out-q4km: 4.89 bits/weight, KL p99 0.31, pp512 212.4 tok/s, tg128 48.1 tok/s (2 threads)`: what llama.cpp's
    users compare, per model of an `--engine llama.cpp` report."""
    if report.get("engine") != "llama.cpp":
        return []
    lines = []
    for m in report["models"]:
        parts = [f"{m['linear_bits_per_weight']:.3f} bits/weight" if m.get("linear_bits_per_weight") else None,
                 f"KL p99 {_get(m, 'quality', 'kl_p99'):.4f}" if _get(m, "quality", "kl_p99") is not None else None]
        bench = m.get("llama_bench")
        if bench:
            parts.append(f"pp512 {bench['pp512_tok_s']:.1f} tok/s, tg128 {bench['tg128_tok_s']:.1f} tok/s "
                         f"({bench['threads']} threads)")
        if any(parts):
            lines.append(f"{m['name']}: {', '.join(x for x in parts if x)}")
    return lines


def summary_line(report: dict, model: dict) -> str:
    """`ppl +1.8%  KL 0.012  TPOT −34%  size −71%` for one model against the baseline."""
    base = next((m for m in report["models"] if m.get("baseline")), report["models"][0])
    kl = _get(model, "quality", "kl_to_baseline")
    parts = [("ppl", fmt_delta(_get(model, "quality", "perplexity"), _get(base, "quality", "perplexity"))),
             ("KL", "" if kl is None else f"{kl:.3g}"),
             ("TPOT", fmt_delta(_get(model, "latency", "tpot_ms", "median"),
                                _get(base, "latency", "tpot_ms", "median"))),
             ("size", fmt_delta(model.get("size_mb"), base.get("size_mb")))]
    return "  ".join(f"{label} {value}" for label, value in parts if value)  # a figure missing on either side: left out


def caption(report: dict) -> str:
    o, mach = report["options"], report["machine"]
    q = next((m["quality"] for m in report["models"] if m.get("quality")), None)
    tokens = f"{q['tokens']} tokens in {q['windows']} windows of {q['seq_len']}" if q else "no perplexity"
    lat = "latency off" if not o.get("latency", True) else (
        f"prompt {o['prompt_len']}, {o['gen_len']} new tokens, median of {o['repeats']}")
    text = f"{report['data']}: {tokens}; {lat}; {mach.get('device')} x{mach.get('torch_threads')} threads"
    if report.get("timing_warning"):
        text += f"; {UNRELIABLE} unreliable timing (busy machine or runs that disagree)"
    return text


QUALITY_COLUMNS = ("model", "ppl", "KL", "top-1", "size MB", "params", "sparsity")
SPEED_COLUMNS = ("model", "TTFT ms", "TPOT ms", "tok/s@batch", "peak MB")


def _table(report: dict, columns: tuple[str, ...], names: list[str], title: str | None, with_caption: bool) -> Table:
    table = Table(title=title, caption=caption(report) if with_caption else None, box=box.SIMPLE_HEAD,
                  padding=(0, 0, 0, 1), pad_edge=False, title_justify="left", caption_justify="left")
    index = [COLUMNS.index(c) for c in columns]
    for i in index:
        table.add_column(_HEADERS[i], justify="left" if i == 0 else "right", no_wrap=True)
    for name, row in zip(names, rows(report)):
        cells = [(name, row[0][1]), *(row[i] for i in index[1:])]
        table.add_row(*(f"{v}\n{d}" if d else v for v, d in cells))
    return table


def rendered_width(renderable) -> int:
    """Columns `renderable` takes when nothing constrains it (serve_table.py measures its table with it too)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=100_000)
    return Measurement.get(console, console.options, renderable).maximum


def rich_table(report: dict, width: int | None = None):
    """The terminal table, deltas under their values. When the one wide table does not fit in `width`
    (a pipe or CI log is 80 columns), two tables with every column: quality and size, then speed and
    memory. Model names are never cut: when they are too long even for those, rows are numbered and
    the names listed above the tables."""
    from rich.console import Group
    from rich.text import Text

    names = [m["name"] for m in report["models"]]
    wide = _table(report, COLUMNS, names, "geminicompress eval", True)
    if width is None or rendered_width(wide) <= width:
        return wide
    parts = [("quality and size", QUALITY_COLUMNS), ("speed and memory", SPEED_COLUMNS)]

    def split(labels: list[str]) -> list[Table]:
        return [_table(report, cols, labels, f"geminicompress eval: {what}", False) for what, cols in parts]

    tables = split(names)
    under = Text(caption(report), style="dim")  # wraps at the console's width, not the narrower table's
    if max(rendered_width(t) for t in tables) <= width:
        return Group(*tables, under)
    keys = [f"[{i + 1}]" for i in range(len(names))]
    legend = Text("\n".join(f"{k} {n}" for k, n in zip(keys, names)))
    return Group(legend, *split(keys), under)


def markdown_table(report: dict) -> str:
    def cell(value: str, delta: str) -> str:
        return (f"{value} ({delta})" if delta else value).replace("\n", " ").replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join([" ".join(row[0]).strip()] + [cell(v, d) for v, d in row[1:]]) + " |"
              for row in rows(report)]
    return "\n".join(lines)
