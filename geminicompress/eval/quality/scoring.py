"""The quality pass: stream the windows through a model once, scoring perplexity and (for a model
that shares the baseline's tokenizer) drift against the baseline's cached log-probs.

Only one chunk of a window's log-probs lives at a time (models/head.py): (c, V) for the model and, for
drift, the baseline's, so memory does not grow with vocabulary x window. `score_windows` takes the
chunks from anywhere (a model bigger than memory: eval/quality/streamed.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from geminicompress.core.metrics import DriftMeter
from geminicompress.eval.quality.baseline_cache import BaselineCache
from geminicompress.eval.quality.perplexity import PerplexityMeter, token_nll
from geminicompress.models.head import window_chunks
from geminicompress.host.progress import NullProgress, Progress


def measure_quality(model, windows: torch.Tensor, device: torch.device, **scoring: Any) -> dict:
    """Perplexity over `windows` (n, T) through `model`, scored by `score_windows` with its keywords
    (label, store, against, base_ppl, progress): with `store` (the baseline) each window's log-probs are
    cached; with `against` KL/agreement to the cached baseline are measured too."""
    chunks = (window_chunks(model, window, device) for window in windows)  # (c, V) log-probs each
    return score_windows(chunks, windows, **scoring)


def score_windows(
    chunks: Iterable[Iterable[torch.Tensor]],
    windows: torch.Tensor,
    *,
    label: str,
    store: BaselineCache | None = None,
    against: BaselineCache | None = None,
    base_ppl: float | None = None,
    progress: Progress | None = None,
) -> dict:
    """Perplexity (and drift against `against`) from each window's next-token log-probs, in window order,
    each window's as consecutive chunks (c, V) covering its T-1 scored positions, as `measure_quality`
    describes."""
    progress = progress or NullProgress()
    ppl, drift = PerplexityMeter(), DriftMeter()
    with progress.task(f"perplexity {label}", windows.shape[0]) as bar:
        for i, (window, parts) in enumerate(zip(windows, chunks)):
            start = 0
            for logp in parts:  # (c, V)
                stop = start + logp.shape[0]
                ppl.add(token_nll(logp, window, start), window=start == 0)
                if store is not None:
                    store.put(i, start, logp)
                if against is not None:
                    drift.add(against.get(i, window, start, stop), logp)
                start = stop
            assert start == windows.shape[1] - 1, "the chunks cover every scored position"
            bar.advance(1, ppl=ppl.perplexity)
    out = {
        "perplexity": round(ppl.perplexity, 6),
        "mean_nll": round(ppl.mean_nll, 8),
        "tokens": ppl.tokens,
        "windows": ppl.windows,
        "seq_len": int(windows.shape[1]),
        "kl_to_baseline": None,
        "top1_agreement": None,
        "ppl_ratio": None,
    }
    if store is not None:  # the baseline itself
        out.update(kl_to_baseline=0.0, top1_agreement=1.0, ppl_ratio=1.0)
    if against is not None:
        out.update(kl_to_baseline=round(drift.kl, 8), top1_agreement=round(drift.agreement, 6))
    if base_ppl:
        out["ppl_ratio"] = round(ppl.perplexity / base_ppl, 6)
    return out
