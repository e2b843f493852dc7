"""How a run goes (`RunOptions`): what the caller decides beside the recipe. The run's plan reads them
(plan.py), the pipeline carries them out (pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from geminicompress.formats.shards import DEFAULT_MAX_BYTES
from geminicompress.host.progress import Progress


@dataclass(frozen=True)
class RunOptions:
    """force: replace OUT when it exists (never an input). stream: run layer by layer from disk: True, False,
    or None to decide from the model's size and whether every stage can stream. verify: compare OUT, loaded
    back, with what the run computed (engine/verify.py). command: what report.json records as the command
    (default: sys.argv). threads: torch's thread count: None leaves it as the caller set it; "auto" takes the
    recipe's `threads:`, else the interrupted run's that this one resumes, else the free cores (host/threads.py);
    a number sets it. recipe_file: the YAML file the recipe came from (an input OUT must never replace)."""

    force: bool = False
    progress: Progress | None = None
    device: torch.device | None = None
    command: list[str] | None = None
    stream: bool | None = None
    verify: bool = True
    max_shard_bytes: int = DEFAULT_MAX_BYTES
    threads: int | Literal["auto"] | None = None
    recipe_file: Path | None = None
