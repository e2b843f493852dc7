"""The serving table and its chart, built from a serve-bench report alone (serving.json), like eval's table.

Columns: TTFT median and p90, TPOT median, throughput in requests/s (and its ratio to the last measured
row above it), KV-cache hit rate, agreement of the greedy answers with the row above's, and perplexity
(of the first row, and with its drift for rows that change the model). A row that was not measured
shows its reason instead.
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table

from geminicompress.eval.table import rendered_width
from geminicompress.output import write_json

_HEADERS = ("row", "TTFT\np50 ms", "TTFT\np90 ms", "TPOT\nms", "req/s\n(x above)", "KV\nhit", "answers\n= above",
            "ppl\n(drift)")
COLUMNS = tuple(h.replace("\n", " ") for h in _HEADERS)  # the same names on one line (markdown)


def cells(report: dict) -> list[list[str]]:
    """One list of strings per row, in COLUMNS order (the reason fills the row when not measured)."""
    out, before = [], None
    for r in report["rows"]:
        m = r.get("metrics")
        if m is None:
            out.append([r["row"], f"not measured: {r['reason']}"] + [""] * (len(COLUMNS) - 2))
            continue
        ttft, tput = m["ttft_ms"], m["throughput_req_s"]
        ratio = f"\n({tput / before:.2f}x)" if before and tput else ""
        ppl, drift = r.get("perplexity"), r.get("ppl_drift")
        out.append([
            r["row"],
            f"{ttft['median']:,.0f}",
            f"{ttft['p90']:,.0f}",
            "n/a" if not m.get("tpot_ms") else f"{m['tpot_ms']['median']:.1f}",
            f"{tput:.3g}{ratio}" if tput else "n/a",
            "n/a" if m.get("kv_hit_rate") is None else f"{m['kv_hit_rate'] * 100:.1f}%",
            "n/a" if r.get("answer_agreement") is None else f"{r['answer_agreement'] * 100:.1f}%",
            "" if ppl is None else f"{ppl:.4g}" + ("" if drift is None or r is report["rows"][0] else
                                                   f"\n({drift * 100:+.2f}%)"),
        ])
        before = tput or before
    return out


def caption(report: dict) -> str:
    w = report["workload"]
    rate = "all at once" if not w["rate"] else f"{w['rate']:g} req/s (Poisson)"
    return (f"{report['engine']}, {report['model']}: {w['requests']} requests, shared prefix {w['prefix_len']} + "
            f"question {w['question_len']} tokens (truncated: {w['truncated_len']}), {w['answer_len']} answer "
            f"tokens, arrivals {rate}, batch up to {report['max_batch']}; {report['data']}")


def _table(report: dict, names: list[str], with_caption: bool) -> Table:
    table = Table(title="geminicompress serve-bench", caption=caption(report) if with_caption else None,
                  box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left")
    for i, c in enumerate(_HEADERS):
        table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for name, row in zip(names, cells(report)):
        table.add_row(name, *row[1:])
    return table


def rich_table(report: dict, width: int | None = None):
    """The terminal table; when it does not fit in `width`, the rows are numbered and their names listed
    above it (nothing is ever cut)."""
    from rich.console import Group
    from rich.text import Text

    names = [r["row"] for r in report["rows"]]
    wide = _table(report, names, True)
    if width is None or rendered_width(wide) <= width:
        return wide
    keys = [f"[{i + 1}]" for i in range(len(names))]
    legend = Text("\n".join(f"{k} {n}: {r['change']}" for k, n, r in zip(keys, names, report["rows"])))
    return Group(legend, _table(report, keys, False), Text(caption(report), style="dim"))


def markdown(report: dict) -> str:
    lines = ["# geminicompress serve-bench", "", caption(report), "",
             "| " + " | ".join(COLUMNS) + " | what the row adds |", "|" + "---|" * (len(COLUMNS) + 1)]
    for row, r in zip(cells(report), report["rows"]):
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + f" | {r['change']} |")
    lines += [""] + [f"- {n}" for n in report.get("notes", [])] + ["", "![the serving rows](serving.png)", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Three panels, one bar per row: TTFT (median, p90 whisker), TPOT, throughput; unmeasured rows say why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["row"] for r in rows][::-1]  # first row on top
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.55 * len(rows) + 1.8), dpi=120, sharey=True)
    panels = [("TTFT s (median, p90)", lambda m: m["ttft_ms"]["median"] / 1000, lambda m: m["ttft_ms"]["p90"] / 1000),
              ("TPOT ms (median)", lambda m: (m.get("tpot_ms") or {}).get("median"), None),
              ("throughput, requests/s", lambda m: m.get("throughput_req_s"), None)]
    for ax, (title, value, high) in zip(axes, panels):
        for y, r in enumerate(rows[::-1]):
            m = r.get("metrics")
            v = value(m) if m else None
            if v is None:
                if ax is axes[0]:
                    ax.text(0, y, "  not measured: " + (r.get("reason") or "")[:60], va="center", fontsize=7,
                            color="0.45")
                continue
            ax.barh(y, v, color="tab:orange" if r.get("model") == "int8" else "tab:blue", height=0.6)
            if high is not None:
                ax.plot([v, high(m)], [y, y], color="0.3", lw=1)
            label = f"{v:,.3g}"
            if ax is axes[2] and m.get("kv_hit_rate"):
                label += f"  (KV hit {m['kv_hit_rate'] * 100:.0f}%)"
            ax.annotate(label, (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7.5)
        ax.set_title(title, fontsize=9.5)
        ax.margins(x=0.35)
        ax.xaxis.set_major_locator(plt.MaxNLocator(4))
    axes[0].set_yticks(range(len(names)), names, fontsize=8.5)
    fig.suptitle("Serving optimizations, each row adding one to the row before (top to bottom)", fontsize=10.5)
    fig.text(0.01, 0.01, caption(report), fontsize=6.5, color="0.4")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)


def write(report: dict, folder: Path) -> None:
    """serving.json, serving.md and serving.png into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "serving.json", report)
    (folder / "serving.md").write_text(markdown(report))
    plot(report, folder / "serving.png")
