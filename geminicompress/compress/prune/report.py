"""What pruning did, layer by layer: the rows of report.json's table and a histogram PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HIGH = 0.9  # a layer losing more than this fraction of its weights is worth a warning


def layer_rows(weights: dict[str, torch.Tensor], layers_path: str) -> list[dict[str, Any]]:
    """One row per pruned weight: name, decoder layer index, linear name, shape, zeros, sparsity."""
    rows = []
    for name, w in weights.items():
        rest = name.removeprefix(f"{layers_path}.")
        index, _, linear = rest.partition(".")
        zeros = int((w == 0).sum())
        rows.append({"name": name, "layer": int(index), "linear": linear.removesuffix(".weight"),
                     "shape": list(w.shape), "params": w.numel(), "zeros": zeros,
                     "sparsity": round(zeros / w.numel(), 6)})
    return rows


def overall(rows: list[dict[str, Any]]) -> float:
    return sum(r["zeros"] for r in rows) / max(1, sum(r["params"] for r in rows))


def write_histogram(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels: sparsity of every pruned linear in model order, and the histogram of those values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    linears = sorted({r["linear"] for r in rows}, key=[r["linear"] for r in rows].index)
    fig, (ax_bar, ax_hist) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    for j, linear in enumerate(linears):
        picked = [(i, r["sparsity"]) for i, r in enumerate(rows) if r["linear"] == linear]
        ax_bar.bar([i for i, _ in picked], [s for _, s in picked], width=1.0, label=linear, color=f"C{j}")
    ax_bar.axhline(HIGH, color="red", linestyle=":", linewidth=1)
    ax_bar.set(xlabel="pruned linear (model order)", ylabel="sparsity", ylim=(0, 1.25), title=title)
    ax_bar.legend(fontsize=7, ncol=min(4, len(linears)), loc="upper right")
    ax_hist.hist([r["sparsity"] for r in rows], bins=40, range=(0, 1), color="C0")
    ax_hist.set(xlabel="sparsity", ylabel="linears", title="per-layer sparsity")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
