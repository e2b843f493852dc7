"""Where distill's memory peak is: phase_rss.py's sampler (resident memory every 20 ms, in this process) with the
training loop's phases labelled: the teacher's forward, the micro-batch, the head's chunks (chunked_head.py) and
their backward, the backward, AdamW, clipping, the held-out perplexity.

  python benchmarks/studies/memory/distill_phase_rss.py distill --teacher smollm2-demo --student-layers 24 --derive even \\
      --repair none --steps 3 --data ../shared/data/enwiki-sample.txt -o SCRATCH/probe --force --threads 1 --quiet

Prints every phase entry (>name) and exit (<name) and every move of more than 100 MB as "seconds GiB phase",
then the peak and its phase. A diagnostic, not a benchmark: whole-process peaks for bars come from
`/usr/bin/time -v`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from studies.memory import phase_rss as P  # noqa: E402


def main() -> None:
    import accelerate
    import torch

    import geminicompress.distill.chunked_head as C
    import geminicompress.distill.train as T
    from geminicompress.cli import main as cli

    P.wrap(T, "_teacher_side", "teacher")
    P.wrap(C._ChunkedLoss, "forward", "chunk_loop")
    P.wrap(C._ChunkedLoss, "backward", "chunk_backward")
    P.wrap(T, "perplexity", "perplexity")
    P.wrap(torch.optim.AdamW, "step", "adamw")
    P.wrap(torch.nn.utils, "clip_grad_norm_", "clip")
    P.wrap(T, "_micro_loss", "micro")
    P.wrap(T, "_optimizer_step", "step")
    P.wrap(accelerate.Accelerator, "backward", "backward")
    P.run_sampled(cli)


if __name__ == "__main__":
    main()
