"""The loss curve: training loss per step and held-out perplexity, one PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def plot_curve(loss: list[float], ppl: list[tuple[int, float]], path: Path, title: str = "distillation") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(loss) + 1), loss, color="tab:blue", lw=1, label="training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss", color="tab:blue")
    if ppl:
        right = ax.twinx()
        steps, values = zip(*ppl)
        right.plot(steps, values, "o-", color="tab:red", ms=3, label="held-out perplexity")
        right.set_ylabel("held-out perplexity", color="tab:red")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
