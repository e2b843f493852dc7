"""The method registry: one row per quantization method, read by the CLI, the schema, the pipeline and
the docs. Adding a method is one new file (its config class and its `run(cfg, ctx)`) plus one row here.

A row says: the method's config (a pydantic stage model with `type: "quantize"` and `method`), the
runner that applies it ("module:function", imported only when the stage runs), its default on-disk
format, whether it needs calibration text, and one line of help.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from geminicompress.compress.rtn import RTNStage
from geminicompress.recipes.quantize import AWQStage, GPTQStage, Int8Stage


@dataclass(frozen=True)
class Method:
    config: type[BaseModel]
    runner: str
    default_format: str
    calibrated: bool
    help: str


METHODS: dict[str, Method] = {
    "rtn": Method(RTNStage, "geminicompress.compress.rtn:run", "gptq", False,
                  "round-to-nearest b-bit weights per group: no calibration, the baseline and the fastest path"),
    "int8": Method(Int8Stage, "geminicompress.compress.int8.stage:run", "compressed-tensors", False,
                   "INT8 weights, float activations (W8A16)"),
    "w8a8": Method(Int8Stage, "geminicompress.compress.int8.stage:run", "compressed-tensors", True,
                   "INT8 weights and per-token INT8 activations (fast on CPU); SmoothQuant calibrates"),
    "gptq": Method(GPTQStage, "geminicompress.compress.gptq.stage:run", "gptq", True,
                   "GPTQ: Hessian-aware rounding, layer by layer (2/3/4/8-bit)"),
    "awq": Method(AWQStage, "geminicompress.compress.awq.stage:run", "awq", True,
                  "AWQ: activation-aware scales and clipping, then round-to-nearest"),
    "awq+gptq": Method(AWQStage, "geminicompress.compress.awq.stage:run", "awq", True,
                       "AWQ's scales and clipping, then GPTQ"),
}


def method(name: str) -> Method:
    from geminicompress.errors import InputError

    if name not in METHODS:
        raise InputError(f"method '{name}' is not one of {', '.join(METHODS)}")
    return METHODS[name]
