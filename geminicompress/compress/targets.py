"""Which linears a method touches: the `ignore` regexes, checked and applied in one place.

Quantization and pruning act on the linears of the decoder layers (`arch.linears` under `arch.layers`);
INT8 acts on every linear of the model. A pattern the user gave that matches nothing is an error: it is
almost always a typo. The b-bit methods (rtn, gptq, awq) open the same way: `weight_quant_targets`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch.nn as nn

from geminicompress.core.arch import Arch, arch_for, get_module
from geminicompress.core.config import ignore_to_check
from geminicompress.core.grid import QuantSpec, auto_group_size
from geminicompress.core.errors import InputError
from geminicompress.engine.whole import tied_head
from geminicompress.formats import check_shapes

if TYPE_CHECKING:
    from geminicompress.core.config import WeightQuantStage


def compile_patterns(ignore: list[str]) -> list[re.Pattern[str]]:
    try:
        return [re.compile(p) for p in ignore]
    except re.error as exc:
        raise InputError(f"ignore pattern '{exc.pattern}' is not a regular expression: {exc}") from exc


def check_patterns_match(patterns: list[re.Pattern[str]], names: list[str], what: str = "linear layer") -> None:
    """Raise InputError naming the first pattern that matches none of `names` (each name a `what`)."""
    for p in patterns:
        if not any(p.search(n) for n in names):
            example = names[-1] if names else "none"
            raise InputError(f"ignore pattern '{p.pattern}' matches no {what} (names look like '{example}')")


def decoder_linears(model: nn.Module, arch: Arch, ignore: list[str], check: list[str] | None = None) -> list[str]:
    """Full names of the decoder-layer linears ("model.layers.3.self_attn.q_proj"), in model order,
    minus those matching an ignore regex (a pattern in `check` matching no linear is an error)."""
    patterns = compile_patterns(ignore)
    layers = get_module(model, arch.layers)
    names = [f"{arch.layers}.{i}.{lin}" for i in range(len(layers)) for lin in arch.linears]
    names = [n for n in names if isinstance(get_module(model, n), nn.Linear)]
    if check:
        check_patterns_match(compile_patterns(check), [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
    return [n for n in names if not any(p.search(n) for p in patterns)]


def present_groups(arch: Arch, present: Callable[[str], bool]) -> list[list[str]]:
    """`arch.sequential` (groups of linears reading one input, in execution order) restricted to the
    linears for which `present(name)` holds; groups left empty are dropped."""
    groups = [[n for n in group if present(n)] for group in arch.sequential]
    return [g for g in groups if g]


def resolve_group_size(group_size: int | str, shapes: Mapping[str, tuple[int, int]], progress: Any) -> int:
    """`group_size` as given, or for "auto" the size `grid.auto_group_size` picks, said in an info line."""
    if group_size != "auto":
        return int(group_size)
    size = auto_group_size([in_f for _, in_f in shapes.values()])
    say_auto(size, progress)
    return size


def say_auto(size: int, progress: Any) -> None:
    """The info line that says which group size "auto" became."""
    progress.info(f"group size {size} (auto: largest of 128/64/32 dividing all inputs; or --group-size)")


@dataclass(frozen=True)
class QuantTargets:
    """What a b-bit stage quantizes: the linears (full names, model order), their (out, in) shapes, the
    resolved spec (group size "auto" made a number) and the architecture table they were found with."""

    arch: Arch
    names: list[str]
    shapes: dict[str, tuple[int, int]]
    spec: QuantSpec


def weight_quant_targets(model: nn.Module, cfg: WeightQuantStage, progress: Any, *, sym: bool,
                         fmt: str | None, planned: QuantTargets | None = None) -> QuantTargets:
    """The decoder linears `cfg.ignore` leaves, their shapes and the spec `cfg.bits`/`cfg.group_size`/`sym`
    give them; with `fmt`, every shape must fit that format under the spec (None: the caller checks per
    module, as mixed precision does). Bad input is an InputError before any work.

    `planned`: what this made of the same stage on the model's skeleton before loading (runtime/plan.py,
    the run's plan). When the model has the same targets, its spec is taken as it is: group size "auto" is
    resolved and the shapes checked once, there (here it is only said)."""
    arch = arch_for(model)
    names = decoder_linears(model, arch, cfg.ignore, check=ignore_to_check(cfg))
    if not names:
        raise InputError("the model has no linear layer left to quantize (check ignore)")
    shapes = {n: tuple(get_module(model, n).weight.shape) for n in names}
    if planned is not None and planned.names == names and planned.shapes == shapes:
        if cfg.group_size == "auto":
            say_auto(planned.spec.group_size, progress)
        return QuantTargets(arch, names, shapes, planned.spec)
    spec = QuantSpec(cfg.bits, resolve_group_size(cfg.group_size, shapes, progress), sym)
    if fmt is not None:
        check_shapes(fmt, shapes, spec)
    return QuantTargets(arch, names, shapes, spec)


def whole_model_targets(model: nn.Module, ignore: list[str], check: list[str], what: str) -> list[str]:
    """The linears not matching `ignore` (nor the output head tied to the embeddings), in model order; each
    pattern in `check` must match a module."""
    patterns = compile_patterns(ignore)
    if check:
        check_patterns_match(compile_patterns(check), [n for n, _ in model.named_modules()], "module of the model")
    tied = tied_head(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != tied
             and not any(p.search(n) for p in patterns)]
    if not names:
        raise InputError(f"the ignore patterns leave no linear layer to {what}")
    return names
