"""Distillation as a stage type (its registry entry): a model stage, run on the model in memory; it trains
the whole model, so it is not streamed, and needs decoder layers to build a student from."""

from __future__ import annotations

from typing import Any

from geminicompress.distill import stage as distill_stage
from geminicompress.distill.config import DistillStage
from geminicompress.distill.streamed_teacher import check_teacher_stream, streamed_input
from geminicompress.distill.student import check_student_layers
from geminicompress.engine.contract import StageContext
from geminicompress.engine.method import Method


class DistillMethod(Method):
    name = "distill"
    type = "distill"
    config = DistillStage
    help = "distill a teacher into a smaller, faster student"
    kind = "model"
    needs = "decoder layers to build a student from"

    @classmethod
    def cannot_stream(cls, cfg: Any, first: bool) -> str | None:
        return "distill trains the whole model and is not streamed; run it with --no-stream"

    @classmethod
    def check_config(cls, cfg: Any, config: dict[str, Any]) -> None:
        """`student_layers` against the layer count in config.json, when its teacher is the recipe's model
        (or what earlier stages made of it: the same layers)."""
        n_layers = config.get("num_hidden_layers")
        if cfg.student_layers is not None and cfg.teacher is None and isinstance(n_layers, int):
            check_student_layers(n_layers, cfg.student_layers, cfg.mlp_ratio)

    @classmethod
    def before_load(cls, cfg: Any, model: str) -> None:
        check_teacher_stream(cfg, model)

    @classmethod
    def run(cls, cfg: Any, ctx: StageContext) -> dict[str, Any]:
        return distill_stage.run(cfg, ctx)

    @classmethod
    def streamed_input(cls, cfg: Any, recipe: Any, progress: Any) -> Any:
        return streamed_input(cfg, recipe, progress)
