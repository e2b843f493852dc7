"""Refuse before loading whatever config.json alone can refuse (issue #34): the architecture, the quantized
linears' shapes against the group size and the on-disk format, an N:M pattern against the pruned linears, a
distilled student's layers against the teacher's.

The model's skeleton is built from config.json with its parameters on the meta device (models/lazy.py, what a
streamed run reads into): no weight is read, so a refusal costs a second, not a load of the model (10 s for a
270M model, 55 s from a GGUF, minutes for a big one). The checks are the stages' own: the architecture from
`arch_for` (the one function that says which layers and linears a model has), the targets and shapes from
`weight_quant_targets` and `check_pattern`. What a method's preflight finds (a b-bit stage's targets, its group
size "auto" resolved) is the run's plan (`engine.contract.Plan`): its stage opens with it, rather than resolving
again. A MODEL without a local config.json (a hub id, a .gguf file) is checked when it has loaded, as before.
"""

from __future__ import annotations

from typing import Any

from geminicompress.core.arch import arch_for
from geminicompress.engine.contract import Plan
from geminicompress.runtime.methods import method_of


def preflight(recipe: Any, model_dir: Any) -> Plan:
    """An InputError when the recipe's stages cannot run on the model whose config.json is in `model_dir`
    (None: nothing to check before loading): each stage's method checks config.json, then the skeleton. Returns
    what the methods found there (the run's plan; empty when nothing was checked)."""
    plan = Plan()
    if model_dir is None:
        return plan
    config = read_config(model_dir)
    if config is not None:
        for stage in recipe.stages:
            method_of(stage).check_config(stage, config)
    stages = [s for s in recipe.stages if method_of(s).kind == "layers"]
    if not stages:
        return plan
    from geminicompress.models.lazy import skeleton

    model = skeleton(model_dir, recipe.trust_remote_code)
    arch = arch_for(model)
    for stage in stages:
        plan.record(stage, method_of(stage).preflight(stage, model, arch))
    return plan


def read_config(model_dir: Any) -> dict[str, Any] | None:
    """`model_dir`/config.json, parsed; None where there is none."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
