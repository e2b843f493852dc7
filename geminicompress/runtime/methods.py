"""The stage registry: one row per quantization method (and one per other stage type), read by the CLI, the
schema, the pipeline and the docs. Adding a method is one new file (its config class and its layer stage)
plus one row here.

A method's row says: its config (a pydantic stage model with `type: "quantize"` and `method`); its layer stage,
"module:Class", imported only when a run uses it (`Class(cfg, ctx)` opens the stage and gives the engine its one
public per-layer function, `layer_fn()`: engine/contract.py); whether a config of it calibrates; its default on-disk
format (its config's `format` choices are the formats it writes); one line of help.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from geminicompress.compress.awq.config import AWQStage
from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.int8.config import Int8Stage
from geminicompress.compress.rtn import RTNStage

ALWAYS: Callable[[Any], bool] = lambda cfg: True  # noqa: E731
NEVER: Callable[[Any], bool] = lambda cfg: False  # noqa: E731


@dataclass(frozen=True)
class Method:
    config: type[BaseModel]
    stage: str  # "module:Class" of its layer stage
    default_format: str
    calibrated: Callable[[Any], bool]  # whether a config of it reads calibration text
    help: str


METHODS: dict[str, Method] = {
    "rtn": Method(RTNStage, "geminicompress.compress.rtn:RTN", "gptq", NEVER,
                  "round-to-nearest b-bit weights per group: no calibration, the baseline and the fastest path"),
    "int8": Method(Int8Stage, "geminicompress.compress.int8.stage:Int8", "compressed-tensors", NEVER,
                   "INT8 weights, float activations (W8A16)"),
    "w8a8": Method(Int8Stage, "geminicompress.compress.int8.stage:Int8", "compressed-tensors",
                   lambda cfg: cfg.smoothquant_alpha is not None,
                   "INT8 weights and per-token INT8 activations (fast on CPU); SmoothQuant calibrates"),
    "gptq": Method(GPTQStage, "geminicompress.compress.gptq.stage:GPTQ", "gptq", ALWAYS,
                   "GPTQ: Hessian-aware rounding, layer by layer (2/3/4/8-bit)"),
    "awq": Method(AWQStage, "geminicompress.compress.awq.stage:AWQ", "awq", ALWAYS,
                  "AWQ: activation-aware scales and clipping, then round-to-nearest"),
    "awq+gptq": Method(AWQStage, "geminicompress.compress.awq.stage:AWQ", "awq", ALWAYS,
                       "AWQ's scales and clipping, then GPTQ"),
}

# Every stage tag -> (its runner "module:name", kind). A "layers" stage is a layer stage class run by the
# engine, one decoder layer at a time; a "model" stage is a function run(cfg, ctx) -> dict on the model in
# memory (distill), and "eval" stages run after OUT is written.
STAGES: dict[str, tuple[str, str]] = {
    **{f"quantize:{name}": (m.stage, "layers") for name, m in METHODS.items()},
    "prune": ("geminicompress.compress.prune.stage:Prune", "layers"),
    "distill": ("geminicompress.distill.stage:run", "model"),
    "eval": ("geminicompress.eval.stage:run", "eval"),
}


def runner(tag: str) -> tuple[Any, str]:
    """(the class or function a stage tag runs, its kind), imported now."""
    path, kind = STAGES[tag]
    module_name, name = path.split(":")
    return getattr(importlib.import_module(module_name), name), kind


def calibrates(cfg: Any) -> bool:
    """Whether stage `cfg` reads calibration text (the one rule: its row's, or the prune criterion's)."""
    if cfg.type == "quantize":
        return METHODS[cfg.method].calibrated(cfg)
    if cfg.type == "prune":
        return cfg.method in ("wanda", "sparsegpt") or cfg.allocation in ("owl", "sensitivity")
    return False
