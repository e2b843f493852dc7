"""Pruning as a method (its registry entry): magnitude (global or per layer), Wanda, SparseGPT, N:M."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.prune.config import PruneStage
from geminicompress.compress.prune.masks import parse_pattern
from geminicompress.compress.prune.stage import CALIBRATED, Prune, check_pattern, prunable_weights
from geminicompress.compress.prune.whole_model import magnitude_whole_model
from geminicompress.core.config import ignore_to_check
from geminicompress.engine.method import Method

# what a calibrated criterion reads in a decoder layer, that a model without decoder layers does not give
NEEDS = {"wanda": "each decoder layer's inputs (Wanda scores |w| by its input's norms)",
         "sparsegpt": "each decoder layer's inputs (SparseGPT's Hessians are gathered layer by layer)"}


class PruneMethod(Method):
    name = "prune"
    type = "prune"
    config = PruneStage
    help = "prune decoder linears: magnitude, wanda, sparsegpt, N:M"
    stage_class = Prune
    default_format = "dense"
    whole_model_label = "magnitude pruning"

    @classmethod
    def calibrates(cls, cfg: Any) -> bool:
        return cfg.method in CALIBRATED or cfg.allocation in ("owl", "sensitivity")

    @classmethod
    def preflight(cls, cfg: Any, skeleton: Any, arch: Any) -> None:
        targets = prunable_weights(skeleton, arch, cfg.ignore, check_ignore=ignore_to_check(cfg))
        check_pattern(targets, parse_pattern(cfg.pattern), cfg.block_size)

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"{cfg.method} layers"

    @classmethod
    def needs_layers(cls, cfg: Any, where: str) -> str | None:
        if cfg.method not in NEEDS:
            return None
        return f"prune {cfg.method}: {where}, and it needs {NEEDS[cfg.method]}"

    @classmethod
    def whole_model_refusal(cls, cfg: Any, where: str) -> str | None:
        if cfg.scope != "global" or cfg.pattern or cfg.format not in ("dense", "compressed-tensors"):
            return (f"prune: {where}: only global magnitude pruning runs on the whole model (no --scope layer, "
                    "--pattern or --allocation)")
        return None

    @classmethod
    def whole_model(cls, model: Any, cfg: Any, dtype: Any, progress: Any) -> Any:
        return magnitude_whole_model(model, cfg, dtype)
