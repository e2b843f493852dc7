"""Teacher-sampled calibration windows for the closed-form repair (self-generated data, as in LLM-QAT, Liu et
al. 2023, "Data-Free Quantization Aware Training for Large Language Models").

The repair's least squares (repair.py) is limited by how many tokens it is fitted on: on the demo, 13-18
dropped, 32 -> 128 -> 256 enwiki windows give 54.27 -> 52.91 -> 52.77 on WikiText-2. A user often has no
more text of the right kind, but the teacher can write more: each new window starts with the first
`PREFIX` tokens of a calibration window (cycled) and the teacher continues it by sampling from its own
distribution at temperature 1 (no top-k/top-p: the whole distribution, so the windows cover what the
teacher would see from text like the prefix, not its most likely continuation only). The windows are
ordinary token ids; they join the repair's fit windows, never the plan's held-out ones (a cut is judged
on real text).

Measured on the demo (32 real enwiki windows + 96 sampled, `benchmarks/studies/distill/repair_synthetic_bench.py`): 13-18
52.99 (as 128 real windows: 52.91), the greedy set 6-7 + 13-15 + 21 50.12 (128 real: 49.23).

Cost: n / batch generate calls of T - PREFIX sampled tokens each (the demo: ~100 s per 32 windows of 512
on 2 CPU cores), and the walk then holds the extra windows ((L + 1) * n * T * d float32, survey.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geminicompress.host.memory import heap_reuse
from geminicompress.models.loading import pad_token_id
from geminicompress.host.progress import NullProgress, Progress

PREFIX = 32  # tokens of a real window each sampled one starts from
TEMPERATURE = 1.0  # the teacher's own distribution


class _Ticks:
    """A generate() stopping criterion that never stops: it advances the progress bar one token per step."""

    def __init__(self, advance) -> None:
        self.advance = advance

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.advance(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def prefix_len(seq_len: int) -> int:
    """Tokens of the real window a sampled window of `seq_len` starts from (at least one token sampled)."""
    return max(1, min(PREFIX, seq_len - 1))


@torch.no_grad()
def teacher_samples(model: nn.Module, windows: torch.Tensor, n: int, *, seed: int, batch: int = 32,
                    progress: Progress | None = None) -> torch.Tensor:
    """n windows (n, T) of token ids: window k starts with the first `prefix_len(T)` tokens of windows[k % len]
    (windows: (m, T)) and the teacher `model` (in memory) continues it by sampling at TEMPERATURE to T tokens.
    The same seed and batch give the same windows; the global RNG is left as it was. The sampling runs where
    the model's weights are (the calibration walk moves one layer at a time to the run's device; a whole
    teacher is not assumed to fit there)."""
    from transformers import StoppingCriteriaList

    progress = progress or NullProgress()
    m, T = windows.shape
    p = prefix_len(T)
    starts = windows[torch.arange(n) % m, :p]  # (n, p)
    device = next(model.parameters()).device
    parts = []
    was_training = model.training
    model.eval()
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    try:
        # heap_reuse: the KV cache grows by a token each step; with the CLI's 1 MB mmap threshold each step's
        # buffers would be fresh, zeroed pages (96 demo windows: unfinished after 8 minutes, a third of the
        # CPU in the kernel, against 4 min 28 s with it)
        with rng, heap_reuse(), progress.task("sampling repair windows", n * (T - p)) as bar:
            torch.manual_seed(seed)
            for b in range(0, n, batch):
                ids = starts[b:b + batch].to(device)  # (b, p)
                ticks = _Ticks(lambda k, rows=ids.shape[0]: bar.advance(rows * k))
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=TEMPERATURE,
                                     top_k=0, top_p=1.0, max_new_tokens=T - p, min_new_tokens=T - p,
                                     pad_token_id=pad_token_id(model), use_cache=True,
                                     stopping_criteria=StoppingCriteriaList([ticks]))
                parts.append(out[:, :T].cpu())  # (b, T)
    finally:
        model.train(was_training)
    return torch.cat(parts)
