"""The sensitivity heat-map: units (rows, model order) x options (columns), log10 of the drift."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def write_heatmap(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    units = table["units"]
    values = np.array([[math.log10(max(v, 1e-9)) for v in u["drift"]] for u in units])  # (units, options)
    fig, ax = plt.subplots(figsize=(2 + 0.9 * len(table["options"]), max(4.0, 0.06 * len(units) + 1.5)))
    im = ax.imshow(values, aspect="auto", cmap="magma_r", interpolation="nearest")
    ax.set_xticks(range(len(table["options"])), table["options"], rotation=45, ha="right", fontsize=8)
    step = max(1, len(units) // 40)
    ax.set_yticks(range(0, len(units), step), [units[i]["name"].split(".", 2)[-1] for i in range(0, len(units), step)],
                  fontsize=6)
    ax.set_title(f"sensitivity ({table['measure']}): log10 KL at the output, nats/token")
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_frontier(allocation: dict[str, Any], path: Path) -> None:
    """Predicted drift vs average bits of every budget the knapsack considered; the chosen point, and the
    measured one when `allocation["measured_drift_pct"]` is there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = allocation["frontier"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["bits"] for p in curve], [max(p["predicted_drift_pct"], 1e-3) for p in curve], "-", color="C0",
            label="predicted (least drift per budget)")
    ax.plot([allocation["average_bits"]], [max(allocation["predicted_drift_pct"], 1e-3)], "o", color="C1",
            label=f"chosen: {allocation['average_bits']:.3f} bits, {allocation['predicted_drift_pct']:.2f}% predicted")
    if allocation.get("measured_drift_pct") is not None:
        ax.plot([allocation["average_bits"]], [max(allocation["measured_drift_pct"], 1e-3)], "s", color="C3",
                label=f"measured: {allocation['measured_drift_pct']:.2f}% ({allocation.get('measured_on', 'eval')})")
    ax.set(xlabel="average stored bits per weight (scales included)", ylabel="perplexity drift, %", yscale="log",
           title="mixed-precision frontier")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
