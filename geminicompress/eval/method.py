"""Evaluation as a stage type (its registry entry): run after OUT is written, on OUT loaded back from disk,
against the recipe's input model; it changes nothing, so it streams and writes no format."""

from __future__ import annotations

from typing import Any

from geminicompress.engine.contract import StageContext
from geminicompress.engine.method import Method
from geminicompress.eval import stage as eval_stage
from geminicompress.eval.config import EvalStage


class EvalMethod(Method):
    name = "eval"
    type = "eval"
    config = EvalStage
    help = "compare OUT with the input model: quality drift vs latency gain"
    kind = "eval"
    needs = ""

    @classmethod
    def run(cls, cfg: Any, ctx: StageContext) -> dict[str, Any]:
        return eval_stage.run(cfg, ctx)
