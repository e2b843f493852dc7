"""What the b-bit weight methods (rtn, gptq, awq, awq+gptq) share as methods: a group size and a packed
format, resolved and checked once, on the model's skeleton before any weight is read (their stage's
`find_targets`: the targets, their shapes, the spec with `group_size: auto` resolved, the format's shape
check), which the stage then opens with (the run's plan); and their progress label."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.targets import QuantTargets
from geminicompress.engine.method import Method
from geminicompress.host.progress import NullProgress


class WeightQuantMethod(Method):
    type = "quantize"
    quantizes = True

    @classmethod
    def preflight(cls, cfg: Any, skeleton: Any, arch: Any) -> QuantTargets:
        """Its stage's targets and spec on the skeleton, for the stage to open with (`contract.Plan`)."""
        return cls.stage_class.find_targets(skeleton, cfg, NullProgress())

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"{cfg.method} {cfg.bits}-bit"
