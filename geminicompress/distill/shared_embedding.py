"""The student's input embedding held once, as the teacher's own frozen table, while it trains.

A student cut from its teacher starts with the teacher's input embedding table. Where its output head is a separate
matrix (untied: Llama 3, Mistral, Qwen), nothing forces the table to move: distillation teaches the layers and the
head to read it as they are. Trained, the table costs its float32 copy, its gradient and AdamW's two moments:
four tables (a 128k x 2048 vocabulary: 3.9 GiB), the biggest term of a 1B-shaped run after the head. Frozen and
shared with the teacher it costs nothing beyond the teacher's own, and the teacher's handling of its table
(frozen_teacher.table_in_file: left in the checkpoint file) then holds for both.

A head tied to the table trains, and the table with it (the demo, Gemma 3): those students keep their own table.
A table that is not the teacher's (a student given as a model, one built from a config) trains too. A streamed
teacher is not in memory to share: a student cut from it freezes its own copy (the same training, without the
gradient and optimizer state).
`--train-embedding` trains an untied table as well. After training the student gets its own copy of the table
again, so what it writes and every later stage of a recipe hold an ordinary tensor.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from geminicompress.distill.shared_prefix import same_tensors


def share_input_embedding(student: nn.Module, teacher: nn.Module | None, derived: bool = False) -> bool:
    """Freeze the student's input embedding where its head is untied and its table is the teacher's (module
    docstring): with the teacher in memory, where the tables are equal, the student's becomes the teacher's module;
    with a streamed teacher (on the meta device), a student `derived` from it keeps its own table, frozen. Returns
    whether the table is frozen."""
    if teacher is None:
        return False
    table, theirs = student.get_input_embeddings(), teacher.get_input_embeddings()
    head = student.get_output_embeddings()
    if (head is None or head.weight is table.weight or type(table) is not type(theirs)
            or table.weight.shape != theirs.weight.shape):
        return False
    if theirs.weight.is_meta:  # streamed: nothing to share, and only a student cut from it holds its table
        if derived:
            table.requires_grad_(False)
        return derived
    if not same_tensors(table, theirs):
        return False
    theirs.requires_grad_(False)
    student.set_input_embeddings(theirs)
    return True


def own_input_embedding(student: nn.Module) -> None:
    """Give the student its own trainable copy of the (shared) input embedding: an ordinary tensor, not the
    teacher's (which may be a read-only view of its checkpoint file), without the teacher's hooks."""
    shared = student.get_input_embeddings()
    own = copy.deepcopy(shared)  # a parameter's deepcopy clones its data
    own._forward_hooks.clear()
    own.requires_grad_(True)
    student.set_input_embeddings(own)
