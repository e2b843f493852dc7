"""Mixed precision in one checkpoint: a quantization spec per module, as the serving tools read it.

- gptq: the top-level bits/group_size are the *base* spec (the one covering most weights); every other
  module gets a GPTQModel `dynamic` override, `"+:^model[.]layers[.]3[.]mlp[.]down_proj$": {"bits": 8,
  "group_size": 64, "sym": true}` (GPTQModel applies the first matching rule; "-:" rules leave a module
  in float).
- compressed-tensors: one `config_groups` entry per spec, each targeting its modules by exact name (vLLM
  and compressed-tensors match exact names before class names; naming every module leaves no overlap).
Pure functions on {module name: spec}; the format modules call them.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from geminicompress.core.grid import QuantSpec
from geminicompress.core.errors import GeminiError


def gptq_dynamic(specs: dict[str, QuantSpec], base: QuantSpec) -> dict[str, dict[str, Any]]:
    """GPTQModel `dynamic` rules for the modules whose spec differs from the base."""
    return {f"+:^{re.escape(n)}$": {"bits": s.bits, "group_size": s.group_size, "sym": s.sym}
            for n, s in specs.items() if s != base}


def dynamic_spec(dynamic: dict[str, dict[str, Any]] | None, name: str, base: QuantSpec) -> QuantSpec:
    """The spec GPTQModel would give module `name`: the first matching positive rule over the base."""
    for key, override in (dynamic or {}).items():
        negative = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("+:", "-:") else key
        if re.match(pattern, name):
            if negative:
                return base  # (a float module has no qweight: never asked)
            return QuantSpec(int(override.get("bits", base.bits)), int(override.get("group_size", base.group_size)),
                             bool(override.get("sym", base.sym)))
    return base


def ct_config_groups(specs: dict[str, QuantSpec], weights_of: Callable[[QuantSpec], dict[str, Any]]) -> dict[str, Any]:
    """One compressed-tensors config group per spec (most weights first is not needed: targets are names)."""
    by_spec: dict[QuantSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    return {f"group_{i}": {"targets": names, "weights": weights_of(spec), "input_activations": None,
                           "output_activations": None, "format": "pack-quantized"}
            for i, (spec, names) in enumerate(by_spec.items())}


def ct_spec_of(groups: dict[str, Any], name: str) -> QuantSpec | None:
    """The weight spec of linear `name` under compressed-tensors config groups (exact name, then "re:"
    regex, then the class name "Linear"), or None."""
    ranked = []
    for group in groups.values():
        w = group.get("weights")
        if not w:
            continue
        for target in group.get("targets", []):
            if target == name:
                ranked.append((0, w))
            elif target.startswith("re:") and re.match(target[3:], name):
                ranked.append((1, w))
            elif target == "Linear":
                ranked.append((2, w))
    if not ranked:
        return None
    w = min(ranked, key=lambda r: r[0])[1]
    if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
        raise GeminiError(f"pack-quantized with {w.get('type')}/{w.get('strategy')} weights is not supported")
    return QuantSpec(int(w["num_bits"]), int(w.get("group_size") or -1) if w["strategy"] == "group" else -1,
                     bool(w.get("symmetric", True)))
