"""What the b-bit weight methods (rtn, gptq, awq, awq+gptq) share as methods: a group size and a packed
format, checked on the model's skeleton before any weight is read (`weight_quant_targets`, the opening of
every b-bit stage: the targets, their shapes, the spec with `group_size: auto` resolved, the format's shape
check), and their progress label."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.targets import weight_quant_targets
from geminicompress.engine.method import Method
from geminicompress.host.progress import NullProgress


class WeightQuantMethod(Method):
    type = "quantize"
    quantizes = True

    @classmethod
    def preflight(cls, cfg: Any, skeleton: Any, arch: Any) -> None:
        fmt = cfg.format if getattr(cfg, "allocation", None) is None else None  # mixed: checked per module
        weight_quant_targets(skeleton, cfg, NullProgress(), sym=True, fmt=fmt)

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"{cfg.method} {cfg.bits}-bit"
