"""Write an eval report: report.json (the figures), report.md (the table), tradeoff.png (the chart).

The chart puts each model at (latency gain, quality drift) against the baseline at the origin:
x = TPOT reduction in % (size reduction when latency was not measured), y = perplexity increase in %.
Each point carries its own label, so the chart reads without a legend: up is worse, right is faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geminicompress import __version__
from geminicompress.eval.table import caption, markdown_table, pct_change, same_dtype_lines, summary_line
from geminicompress.host.machine import machine, versions
from geminicompress.host.output import write_json
from geminicompress.eval.config import EvalStage


def new_entry(spec: str, name: str, is_base: bool) -> dict:
    """A model's report entry before it is measured (its keys in report.json order; api.py and vllm_eval.py fill one)."""
    return {"name": name, "path": spec, "baseline": is_base, "format": None, "dtype": None, "quality": None,
            "latency": None, "peak_memory_mb": None, "tensors_mb": None, "size_mb": None, "masks_mb": None,
            "params": None, "sparsity": None, "quant_zeros": None, "kernel": None, "dtype_baseline": False, "tasks": None,
            "streamed": None, "notes": []}


@dataclass(frozen=True)
class ReportMachine:
    """What a report says of where the models ran: the device ("cpu", "cuda", "vllm") and the thread count."""

    device: str
    threads: int


def new_report(baseline: str, data: str, options: EvalStage, models: list[dict], where: ReportMachine,
               timing_warning: str | None = None, speculative: dict | None = None, **engine) -> dict:
    """The report of `evaluate` (keys in report.json order; vllm_eval.py puts its `engine` keys after the version)."""
    return {"geminicompress": __version__, **engine, "baseline": baseline, "timing_warning": timing_warning,
            "data": data, "options": options.model_dump(mode="json", exclude={"type", "data"}),
            "machine": {**machine(), "device": where.device, "torch_threads": where.threads}, "versions": versions(),
            "models": models, "speculative": speculative}


def tradeoff_points(report: dict) -> tuple[str, list[tuple[str, float, float]]]:
    """(x-axis label, [(name, x, y)]) for every model that has the figures."""
    models = report["models"]
    base = next((m for m in models if m.get("baseline")), models[0])

    def tpot(m: dict) -> float | None:
        return ((m.get("latency") or {}).get("tpot_ms") or {}).get("median")

    def ppl(m: dict) -> float | None:
        return (m.get("quality") or {}).get("perplexity")

    use_latency = tpot(base) is not None
    xlabel = ("latency gain: time per output token, reduction vs baseline (%)" if use_latency
              else "size on disk, reduction vs baseline (%)")
    points = []
    for m in models:
        x = pct_change(tpot(m), tpot(base)) if use_latency else pct_change(m.get("size_mb"), base.get("size_mb"))
        y = pct_change(ppl(m), ppl(base))
        if x is not None and y is not None:
            points.append((m["name"], -x, y))
    return xlabel, points


def _signed(pct: float) -> str:
    return f"+{pct:.1f}%" if pct >= 0 else f"\u2212{-pct:.1f}%"


def plot_tradeoff(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, points = tradeoff_points(report)
    what = "TPOT" if xlabel.startswith("latency") else "size"
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.axhline(0, color="0.7", lw=0.8)
    ax.axvline(0, color="0.7", lw=0.8)
    base_name = next((m["name"] for m in report["models"] if m.get("baseline")), None)
    for name, x, y in points:
        is_base = name == base_name
        ax.scatter([x], [y], s=60, color="0.4" if is_base else "tab:blue", zorder=3)
        label = f"{name}\n(baseline)" if is_base else f"{name}\nppl {_signed(y)}, {what} {_signed(-x)}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(7, 7), fontsize=8.5)
    if not points:
        ax.text(0.5, 0.5, "no model has both perplexity and latency figures", transform=ax.transAxes,
                ha="center", va="center")
    xs = [p[1] for p in points] or [0.0]
    ys = [p[2] for p in points] or [0.0]
    pad_x = max(5.0, 0.25 * (max(xs) - min(xs)))
    pad_y = max(1.0, 0.25 * (max(ys) - min(ys)))
    ax.set_xlim(min(xs + [0.0]) - pad_x, max(xs + [0.0]) + 2.5 * pad_x)  # room for labels on the right
    ax.set_ylim(min(ys + [0.0]) - pad_y, max(ys + [0.0]) + pad_y)
    ax.set_xlabel(xlabel + "  \u2192 faster")
    ax.set_ylabel("quality drift: perplexity increase vs baseline (%)  \u2192 worse")
    ax.set_title("Quality drift vs latency gain", fontsize=11)
    fig.text(0.01, 0.01, caption(report), fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def markdown_report(report: dict) -> str:
    lines = ["# geminicompress eval", "", caption(report), "", markdown_table(report), ""]
    if report.get("timing_warning"):
        lines += [f"**Warning:** {report['timing_warning']}.", ""]
    base = next((m for m in report["models"] if m.get("baseline")), None)
    for m in report["models"]:
        if m is not base and summary_line(report, m):
            lines.append(f"- **{m['name']}**: {summary_line(report, m)}")
        for note in m.get("notes", []):
            lines.append(f"- {m['name']}: {note}")
    same = same_dtype_lines(report)
    if same:
        lines += ["", "Against the baseline in the same activation dtype:", ""] + [f"- {line}" for line in same]
    tasks = [(m["name"], m["tasks"]) for m in report["models"] if m.get("tasks")]
    if tasks:
        lines += ["", "## Downstream tasks (lm-eval-harness)", ""]
        lines += [f"- {name}: " + "; ".join(f"{task} " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                                            for task, metrics in scores.items()) for name, scores in tasks]
    spec = report.get("speculative")
    if spec:
        lines += ["", "## Speculative decoding", "", "```", *(f"{k}: {v}" for k, v in spec.items()), "```"]
    lines += ["", "![quality drift vs latency gain](tradeoff.png)", ""]
    return "\n".join(lines)


def write_report(report: dict, folder: Path) -> None:
    """Write report.json, report.md and tradeoff.png into `folder` (created if needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "report.json", report)
    (folder / "report.md").write_text(markdown_report(report))
    plot_tradeoff(report, folder / "tradeoff.png")
