"""Train only the student's tail: its leading blocks are the teacher's own, frozen, and shared.

A student cut by measurement keeps the teacher's first blocks untouched up to the block before its first
cut (the repair changes that one). With those blocks and the input embedding frozen, the student's hidden
state entering block k is, bitwise, the teacher's hidden state entering block k, which the teacher's
forward computes anyway. So each training step runs the teacher once, takes its input to block k, and runs
the student from block k on: no forward and no backward through the k shared blocks. On the demo (24 of 30
layers, the first cut after block 12) that is a third less work per token (docs/distill.md).

Nothing is approximated: `prefix_length` counts only blocks whose tensors equal the teacher's exactly, and
the student's prefix blocks are replaced, for that forward only, by stubs that hand on the teacher's tensor
(the same stubs the layer walk uses, engine/layers.py). A tied head is frozen with the embedding it shares
(training it would move the embedding the frozen prefix reads).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for, get_module
from geminicompress.engine.layers import as_layer_output, layer_input


def prefix_length(student: nn.Module, teacher: nn.Module) -> int:
    """How many leading decoder blocks of `student` equal the teacher's, tensor for tensor (0 when their
    architectures or input embeddings differ)."""
    arch_s, arch_t = arch_for(student), arch_for(teacher)
    if arch_s != arch_t or not same_tensors(student.get_input_embeddings(), teacher.get_input_embeddings()):
        return 0
    s_layers, t_layers = get_module(student, arch_s.layers), get_module(teacher, arch_t.layers)
    k = 0
    while k < min(len(s_layers), len(t_layers)) and same_tensors(s_layers[k], t_layers[k]):
        k += 1
    return min(k, len(s_layers) - 1)  # at least one block trains


def freeze_prefix(student: nn.Module, k: int) -> None:
    """Freeze the input embedding (and a head tied to it) and decoder blocks 0..k-1."""
    student.get_input_embeddings().requires_grad_(False)
    for layer in get_module(student, arch_for(student).layers)[:k]:
        layer.requires_grad_(False)


class TeacherInput:
    """Captures the teacher's hidden state entering decoder block k during its forward."""

    def __init__(self, teacher: nn.Module, k: int):
        self.value: torch.Tensor | None = None
        self._handle = get_module(teacher, arch_for(teacher).layers)[k].register_forward_pre_hook(
            self._capture, with_kwargs=True)

    def _capture(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.value = layer_input(args, kwargs).detach()

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("the teacher's forward did not reach the shared block")
        return value

    def close(self) -> None:
        self._handle.remove()


@contextmanager
def starting_at(student: nn.Module, k: int, hidden: torch.Tensor) -> Iterator[None]:
    """For forwards inside the block: the student's blocks 0..k-1 do no work and block k reads `hidden`
    (the teacher's input to its block k, (B, T, d)) in place of what reaches it."""
    arch = arch_for(student)
    layers = get_module(student, arch.layers)

    def stub(*args: Any, **kwargs: Any) -> Any:
        return as_layer_output(hidden, arch.output_tuple)

    for layer in layers[:k]:
        layer.forward = stub
    try:
        yield
    finally:
        for layer in layers[:k]:
            del layer.forward


def same_tensors(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[n].shape == sb[n].shape and torch.equal(sa[n], sb[n]) for n in sa)
