"""Refuse before loading whatever config.json alone can refuse (issue #34): the architecture, the quantized
linears' shapes against the group size and the on-disk format, an N:M pattern against the pruned linears, a
distilled student's layers against the teacher's.

The model's skeleton is built from config.json with its parameters on the meta device (models/lazy.py, what a
streamed run reads into): no weight is read, so a refusal costs a second, not a load of the model (10 s for a
270M model, 55 s from a GGUF, minutes for a big one). The checks are the stages' own: the architecture from
`arch_for` (the one function that says which layers and linears a model has), the targets and shapes from
`weight_quant_targets` and `check_pattern`, which the stages call again when they open. A MODEL without a local
config.json (a hub id, a .gguf file) is checked when it has loaded, as before.
"""

from __future__ import annotations

from typing import Any

from geminicompress.compress.prune.masks import parse_pattern
from geminicompress.compress.prune.stage import check_pattern, prunable_weights
from geminicompress.compress.targets import weight_quant_targets
from geminicompress.core.arch import arch_for
from geminicompress.core.config import ignore_to_check
from geminicompress.distill.student import check_student_layers
from geminicompress.host.progress import NullProgress

_WEIGHT_QUANT = ("rtn", "gptq", "awq", "awq+gptq")  # the b-bit methods: a group size and a packed format


def preflight(recipe: Any, model_dir: Any) -> None:
    """An InputError when the recipe's layer stages cannot run on the model whose config.json is in
    `model_dir` (None: nothing to check before loading)."""
    if model_dir is None:
        return
    _student_layers(recipe, model_dir)
    stages = [s for s in recipe.stages if s.type in ("quantize", "prune")]
    if not stages:
        return
    from geminicompress.models.lazy import skeleton

    model = skeleton(model_dir, recipe.trust_remote_code)
    arch = arch_for(model)
    for stage in stages:
        if stage.type == "prune":
            targets = prunable_weights(model, arch, stage.ignore, check_ignore=ignore_to_check(stage))
            check_pattern(targets, parse_pattern(stage.pattern), stage.block_size)
        elif stage.method in _WEIGHT_QUANT:
            fmt = stage.format if getattr(stage, "allocation", None) is None else None  # mixed: checked per module
            weight_quant_targets(model, stage, NullProgress(), sym=True, fmt=fmt)


def _student_layers(recipe: Any, model_dir: Any) -> None:
    """A distill stage's `student_layers` against the layer count in config.json, when its teacher is the
    recipe's model (or what earlier stages made of it: the same layers)."""
    cuts = [s for s in recipe.stages if s.type == "distill" and s.student_layers is not None and s.teacher is None]
    config = read_config(model_dir) if cuts else None
    if config is None:
        return
    for cut in cuts:
        check_cut(config, cut.student_layers, cut.mlp_ratio)


def read_config(model_dir: Any) -> dict[str, Any] | None:
    """`model_dir`/config.json, parsed; None where there is none."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_cut(config: dict[str, Any], student_layers: Any, mlp_ratio: float) -> None:
    """A student's layers (a count, a fraction or indices) against the teacher config's layer count, where it
    gives one: the one-line refusal of a count the teacher cannot give, before anything loads."""
    n_layers = config.get("num_hidden_layers")
    if student_layers is not None and isinstance(n_layers, int):
        check_student_layers(n_layers, student_layers, mlp_ratio)
