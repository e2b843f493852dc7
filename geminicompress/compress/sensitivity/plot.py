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
