"""The registry: the list of stage types a recipe may name, one class each (`engine/method.py: Method`).
The CLI (`--method`, its help), the recipe schema's union, the pipeline, preflight, the streaming rule and
the whole-model fallback read it. Adding a method is one folder (`compress/<method>/method.py` beside its
config and layer stage) and one entry here (docs/extending.md).
"""

from __future__ import annotations

from typing import Any

from geminicompress.compress.awq.method import AWQGPTQMethod, AWQMethod
from geminicompress.compress.gptq.method import GPTQMethod
from geminicompress.compress.int8.method import Int8Method, W8A8Method
from geminicompress.compress.prune.method import PruneMethod
from geminicompress.compress.rtn.method import RTNMethod
from geminicompress.distill.method import DistillMethod
from geminicompress.engine.method import Method
from geminicompress.eval.method import EvalMethod

REGISTRY: list[type[Method]] = [RTNMethod, Int8Method, W8A8Method, GPTQMethod, AWQMethod, AWQGPTQMethod,
                                PruneMethod, DistillMethod, EvalMethod]

# the quantize methods by `--method` name; every stage type by its tag in the recipe schema (`stage_tag`)
METHODS: dict[str, type[Method]] = {m.name: m for m in REGISTRY if m.type == "quantize"}
STAGES: dict[str, type[Method]] = {m.tag(): m for m in REGISTRY}
STAGE_TYPES = tuple(dict.fromkeys(m.type for m in REGISTRY))


def stage_tag(value: Any) -> str | None:
    """The schema's discriminator: 'quantize:<method>' for quantize stages, else the type (a stage config or
    its dict)."""
    get = value.get if isinstance(value, dict) else lambda k, d=None: getattr(value, k, d)
    kind = get("type")
    return f"{kind}:{get('method')}" if kind == "quantize" else kind


def method_of(cfg: Any) -> type[Method]:
    """The stage type of stage config `cfg`."""
    return STAGES[stage_tag(cfg)]
