"""The serving table and its chart, built from a serve-bench report alone (serving.json), like eval's table.

Columns: whether the row joined the stack (stack.py's rule), its capacity in requests/s in a burst (and its
ratio to the stack it was added to), TTFT with one request alone beside TTFT p50 / p90 under the run's load,
TPOT under load (alone), KV-cache hit rate, agreement of the greedy answers with the first row's, and
perplexity (of the first row, and with its drift for rows that change the model). A row that was not
measured shows its reason instead. Below the table: the load, and the comparisons the rows exist for
(student against the teacher's stack, speculative decoding against its verifier alone).
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table

from geminicompress.eval.cost.contention import BUSY_MIN_CORES
from geminicompress.eval.serving.stack import tpot_ratio
from geminicompress.eval.table import rendered_width
from geminicompress.host.output import write_json

_HEADERS = ("row", "stack", "burst req/s\n(x stack)", "TTFT ms\nalone", "TTFT ms\np50 (p90)", "TPOT ms\n(alone)",
            "KV\nhit", "answers\n= first", "ppl\n(drift)")
COLUMNS = tuple(h.replace("\n", " ") for h in _HEADERS)  # the same names on one line (markdown)
MARKS = {"stack": "start", "stacked": "+ stacked", "lost": "x lost", "trade": "~ trade"}


def _ms(m: dict | None, key: str, stat: str = "median") -> float | None:
    return ((m or {}).get(key) or {}).get(stat)


def _cell(r: dict, first: bool) -> list[str]:
    m, alone = r["metrics"], r.get("alone")
    ratio = "" if r.get("speedup") is None else f"\n({r['speedup']:.2f}x)"
    cap = r.get("capacity_req_s")
    tpot, tpot_alone = _ms(m, "tpot_ms"), _ms(alone, "tpot_ms")
    ppl, drift = r.get("perplexity"), r.get("ppl_drift")
    return [
        r["row"],
        MARKS.get(r.get("mark"), "") + (" *" if r.get("overloaded") else "") + (" !" if r.get("busy") else ""),
        ("n/a" if not cap else f"{cap:.3g}") + ratio,
        "n/a" if _ms(alone, "ttft_ms") is None else f"{_ms(alone, 'ttft_ms'):,.0f}",
        f"{_ms(m, 'ttft_ms'):,.0f}\n({_ms(m, 'ttft_ms', 'p90'):,.0f})",
        ("n/a" if tpot is None else f"{tpot:.1f}") + ("" if tpot_alone is None else f"\n({tpot_alone:.1f})"),
        "n/a" if m.get("kv_hit_rate") is None else f"{m['kv_hit_rate'] * 100:.1f}%",
        "n/a" if r.get("answer_agreement") is None else f"{r['answer_agreement'] * 100:.1f}%",
        "" if ppl is None else f"{ppl:.4g}" + ("" if drift is None or first else f"\n({drift * 100:+.2f}%)"),
    ]


def cells(report: dict) -> list[list[str]]:
    """One list of strings per row, in COLUMNS order (the reason fills the row when not measured)."""
    out, first = [], True
    for r in report["rows"]:
        if r.get("metrics") is None:
            out.append([r["row"], "", f"not measured: {r['reason']}"] + [""] * (len(COLUMNS) - 3))
            continue
        out.append(_cell(r, first))
        first = False
    return out


def comparisons(report: dict) -> list[str]:
    """The lines below the table: the stack, overloaded rows, and each model row's comparison with what it
    replaces: INT8/INT4 against the stack they were added to, the student against the teacher's stack (the
    best row serving MODEL itself), speculative decoding against its verifier (the same row) alone."""
    rows = {r["row"]: r for r in report["rows"] if r.get("metrics")}
    load = report["load"]
    teacher = ([r for r in rows.values() if r["model"] == "base" and r.get("mark") in ("stack", "stacked")]
               or [None])[-1]
    out = [f"stack: {load['stack']} (each row is added to the best row above it: faster in the burst at equal "
           f"answers; x lost = slower, ~ trade = faster but other answers: both left out of the stack)"]
    if any(r.get("overloaded") for r in rows.values()):
        out.append("* capacity below the load: the queue grows, TTFT under load is queueing")
    busy = [(name, sec, c["other_cores"]) for name, r in rows.items() if r.get("busy")
            for sec, c in (r.get("contention") or {}).items() if c["other_cores"] >= BUSY_MIN_CORES]
    if busy:
        out.append("! timed while other processes kept cores busy (unreliable; rerun on a quiet machine): "
                   + ", ".join(f"{n} {sec} {c:.1f} cores" for n, sec, c in busy))
    for name, r in rows.items():
        below = rows.get(r.get("added_to")) if r["model"] in ("int8", "int4") else teacher
        if r["model"] != "base" and below is not None:
            alone = tpot_ratio(_ms(r.get("alone"), "tpot_ms"), _ms(below.get("alone"), "tpot_ms"))
            ttft = tpot_ratio(_ms(r.get("alone"), "ttft_ms"), _ms(below.get("alone"), "ttft_ms"))
            kernel = f", kernel {r['kernel']} ({r.get('activation_dtype')})" if r.get("kernel") else ""
            out.append(f"{name}: {r.get('speedup') or 0:.2f}x the burst req/s of {below['row']}, TTFT alone "
                       f"{ttft or float('nan'):.2f}x its, TPOT alone {alone or float('nan'):.2f}x its{kernel}"
                       f"{_why_lost(r, ttft, alone)}")
        acc = r.get("acceptance")
        if acc and teacher is not None:
            ratio = tpot_ratio(_ms(r.get("alone"), "tpot_ms"), _ms(teacher.get("alone"), "tpot_ms"))
            same = r.get("verifier_agreement")
            out.append(f"{name}: acceptance {acc['accepted'] / max(1, acc['proposed']):.1%} of proposed draft tokens, "
                       f"{acc['accepted'] / max(1, acc['rounds']):.2f} accepted per verification step; answers "
                       f"{'n/a' if same is None else f'{same:.1%}'} equal to the verifier's ({teacher['row']}"
                       f"{_ties(r.get('divergences'))}); "
                       f"TPOT alone {ratio or float('nan'):.2f}x the verifier's alone")
    return out


def _why_lost(r: dict, ttft: float | None, tpot: float | None) -> str:
    """For a model row that lost in the burst: which of its two phases made it lose (a burst serves prompts and
    answers: a row faster per answer token can lose on reading the prompts)."""
    if r.get("mark") != "lost" or ttft is None or tpot is None:
        return ""
    if tpot < 1 <= ttft:
        return "; lost on the prompts: faster per answer token, slower to read a prompt"
    if ttft < 1 <= tpot:
        return "; lost on the answers: faster to read a prompt, slower per answer token"
    if min(ttft, tpot) >= 1:
        return "; lost on both the prompts and the answers"
    return "; lost in the burst's batches, though faster alone in both phases"


def _ties(found: dict | None) -> str:
    """", 2 answers leave it, 1 at a float tie (logit gaps 3e-06, 1.2)" for the speculative row."""
    if not found or not found.get("requests"):
        return ""
    gaps = found.get("logit_gaps")
    if gaps is None:
        return f", {found['requests']} answers leave it"
    return (f", {found['requests']} answers leave it, {found['ties']} at a float tie (logit gaps "
            f"{', '.join(f'{g:.2g}' for g in gaps)})")


def caption(report: dict) -> str:
    w, load = report["workload"], report["load"]
    return (f"{report['engine']}, {report['model']}: {w['requests']} requests, shared prefix {w['prefix_len']} + "
            f"question {w['question_len']} tokens (truncated: {w['truncated_len']}), {w['answer_len']} answer "
            f"tokens, batch up to {report['max_batch']}; capacity: a burst of {load['capacity_requests']}; timed "
            f"{'as ' + load['how'] if load.get('concurrency') else 'at ' + load['how'] + ' (Poisson)'}; alone: {load['alone_requests']} requests one after another; {report['data']}")


def _table(report: dict, names: list[str], with_caption: bool) -> Table:
    """The rows under `names`; without the caption (the narrow form) a row not measured says only that, its
    reason is in the legend above."""
    table = Table(title="geminicompress serve-bench", caption=caption(report) if with_caption else None,
                  box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left", padding=(0, 1 if with_caption else 0))
    for i, c in enumerate(_HEADERS):
        table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for name, row, r in zip(names, cells(report), report["rows"]):
        if r.get("metrics") is None and not with_caption:
            row = [row[0], "not measured"] + [""] * (len(row) - 2)
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
        return Group(wide, Text("\n".join(comparisons(report))))
    keys = [f"[{i + 1}]" for i in range(len(names))]
    legend = Text("\n".join(f"{k} {n}: {r['change']}" + ("" if r.get("metrics") else f" (not measured: {r['reason']})")
                            for k, n, r in zip(keys, names, report["rows"])))
    return Group(legend, _table(report, keys, False), Text(caption(report), style="dim"),
                 Text("\n".join(comparisons(report))))


def markdown(report: dict) -> str:
    lines = ["# geminicompress serve-bench", "", caption(report), "",
             "| " + " | ".join(COLUMNS) + " | what the row adds |", "|" + "---|" * (len(COLUMNS) + 1)]
    for row, r in zip(cells(report), report["rows"]):
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + f" | {r['change']} |")
    notes = comparisons(report) + report.get("notes", [])
    lines += [""] + [f"- {n}" for n in notes] + ["", "![the serving rows](serving.png)", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Three panels, one bar per row: TTFT under load (median, p90 whisker; a tick at TTFT alone), TPOT under
    load, capacity in the burst; rows left out of the stack in grey; unmeasured rows say why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["row"] for r in rows][::-1]  # first row on top
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.55 * len(rows) + 1.8), dpi=120, sharey=True)
    panels = [("TTFT s under load (median, p90; | alone)", lambda r: r["metrics"]["ttft_ms"]["median"] / 1000,
               lambda r: r["metrics"]["ttft_ms"]["p90"] / 1000),
              ("TPOT ms under load (median)", lambda r: _ms(r["metrics"], "tpot_ms"), None),
              ("capacity, requests/s in a burst", lambda r: r.get("capacity_req_s"), None)]
    for ax, (title, value, high) in zip(axes, panels):
        for y, r in enumerate(rows[::-1]):
            m = r.get("metrics")
            v = value(r) if m else None
            if v is None:
                if ax is axes[0]:
                    ax.text(0, y, "  not measured: " + (r.get("reason") or "")[:60], va="center", fontsize=7,
                            color="0.45")
                continue
            ax.barh(y, v, color="tab:blue" if r.get("mark") in ("stack", "stacked") else "0.7", height=0.6)
            if high is not None:
                ax.plot([v, high(r)], [y, y], color="0.3", lw=1)
                if _ms(r.get("alone"), "ttft_ms") is not None:
                    ax.plot([_ms(r["alone"], "ttft_ms") / 1000] * 2, [y - 0.3, y + 0.3], color="tab:red", lw=1.5)
            label = f"{v:,.3g}"
            if ax is axes[2] and m.get("kv_hit_rate"):
                label += f"  (KV hit {m['kv_hit_rate'] * 100:.0f}%)"
            ax.annotate(label, (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7.5)
        ax.set_title(title, fontsize=9.5)
        ax.margins(x=0.35)
        ax.xaxis.set_major_locator(plt.MaxNLocator(4))
    axes[0].set_yticks(range(len(names)), names, fontsize=8.5)
    fig.suptitle("Serving optimizations, each row added to the best row above it (blue: in the stack)", fontsize=10.5)
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
