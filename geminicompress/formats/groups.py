"""Whole groups: the one check that a quantization group divides a linear's input features, for every format
that stores whole groups (gptq, compressed-tensors, awq). Each declares its `GROUPS = Groups(...)`: whether it
holds one group per output channel, and how it words the refusal; `formats.check_shapes` runs the check."""

from __future__ import annotations

from dataclasses import dataclass

from geminicompress.core.errors import InputError
from geminicompress.core.grid import QuantSpec


@dataclass(frozen=True)
class Groups:
    """What a format that stores whole groups declares (its `GROUPS`): whether it holds one group per output
    channel (group size -1), and its refusal of a group size that does not divide a layer's inputs, with the
    fields `name`, `in_f` (the layer's input features) and `group` (the group size)."""

    per_channel: bool = True
    refusal: str = ("{name}: group size {group} does not divide the {in_f} input features; choose a divisor of "
                    "{in_f} (or -1 for per channel)")


def check_groups(name: str, in_f: int, spec: QuantSpec, groups: Groups | None) -> None:
    """Raise InputError when a format that stores whole groups (`groups`; None: any group fits) cannot hold
    linear `name`'s `in_f` inputs under `spec`'s group size."""
    if groups is None:
        return
    if not spec.whole_groups(in_f) or (spec.group_size == -1 and not groups.per_channel):
        raise InputError(groups.refusal.format(name=name, in_f=in_f, group=spec.group_size))
