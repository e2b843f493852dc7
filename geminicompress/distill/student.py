"""The student: a smaller model of the teacher's architecture, initialised from the teacher's weights.

DistilBERT-style derivation (Sanh et al., 2019): keep a subset of the teacher's decoder layers (evenly
spaced, first and last kept) and copy their weights exactly; optionally keep only the MLP channels with
the largest norms (`mlp_ratio`). The result is an ordinary transformers model of the teacher's
`model_type`, built from a copy of its config with `num_hidden_layers` (and per-layer lists such as
`layer_types`) updated, so it saves, loads and generates like any other checkpoint.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for
from geminicompress.core.errors import InputError
from geminicompress.models.lazy import LazyCheckpoint


def keep_count(n_layers: int, spec: int | float) -> int:
    """How many layers a count (24) or a fraction (0.8) of a teacher with n_layers keeps (1 .. n_layers;
    check_student_layers says which of these a user may ask for)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if not 1 <= spec <= n_layers:
            raise InputError(f"student_layers {spec}: a student of a {n_layers}-layer teacher keeps 1 .. "
                             f"{n_layers} layers (or give a fraction such as 0.8)")
        return spec
    return max(1, round(spec * n_layers))


def check_student_layers(n_layers: int, spec: int | float | list[int], mlp_ratio: float = 1.0) -> list[int]:
    """The teacher layers a user's `student_layers` keeps (keep_layers), refused in one line when the teacher
    cannot give them: a count outside 1 .. n_layers - 1, a layer out of range, or every layer with every MLP
    channel (a copy of the teacher). Every layer is a student when it is narrower (`mlp_ratio` < 1: a width cut)."""
    narrower = mlp_ratio < 1.0
    if isinstance(spec, int) and not isinstance(spec, bool) and not 1 <= spec <= n_layers:
        raise InputError(f"student_layers {spec}: a student of a {n_layers}-layer teacher keeps 1 .. "
                         f"{n_layers if narrower else n_layers - 1} layers (or give a fraction such as 0.8)")
    kept = keep_layers(n_layers, spec)
    if len(kept) == n_layers and not narrower:
        said = "(a list)" if isinstance(spec, list) else str(spec)
        raise InputError(f"student_layers {said} keeps all {n_layers} layers and every MLP channel: the student "
                         "would be a copy of the teacher; keep fewer layers (e.g. --student-layers 0.8) or MLP "
                         "channels (e.g. --mlp-ratio 0.75)")
    return kept


def keep_layers(n_layers: int, spec: int | float | list[int]) -> list[int]:
    """Teacher layer indices the student keeps: a count or a fraction (evenly spaced, first and last
    kept) or a list."""
    if isinstance(spec, list):
        bad = [i for i in spec if not -n_layers <= i < n_layers]
        if bad:
            raise InputError(f"student_layers: layer {bad[0]} is out of range for a teacher with "
                             f"{n_layers} layers (use 0..{n_layers - 1})")
        kept = sorted({i % n_layers for i in spec})
        if len(kept) != len(spec):
            raise InputError("student_layers: the list names the same layer twice (negative indices count from the end)")
        return kept
    n_keep = keep_count(n_layers, spec)
    if n_keep == 1:
        return [0]
    # (n_keep,) evenly spaced positions over [0, L-1]; with L=30 and 15 kept: 0, 2, 4, ..., 27, 29
    return sorted({round(i * (n_layers - 1) / (n_keep - 1)) for i in range(n_keep)})


def evenly_mapped(n_student: int, n_teacher: int) -> dict[int, int]:
    """Default student -> teacher layer map for hidden-state losses when the student was not derived."""
    return {j: round((j + 1) * n_teacher / n_student) - 1 for j in range(n_student)}


def boundary_mapped(kept: list[int], n_teacher: int) -> dict[int, int]:
    """Default student -> teacher layer map for hidden-state losses of a derived student: student layer j
    matches the teacher's hidden state that its next layer (a copy of teacher layer kept[j + 1]) reads, the
    output of teacher layer kept[j + 1] - 1; the last matches the teacher's last. Where layers were dropped
    after j the student's layer j stands for them (what the closed-form repair fits it to), so it is not held
    to its own copy's output: with 13-18 of 30 dropped, student 12 -> teacher 18."""
    return {j: (kept[j + 1] - 1 if j + 1 < len(kept) else n_teacher - 1) for j in range(len(kept))}


def student_config(teacher_config: Any, kept: list[int], mlp_ratio: float = 1.0) -> Any:
    """A copy of the teacher's config for `len(kept)` layers (and a narrower MLP when mlp_ratio < 1)."""
    config = copy.deepcopy(teacher_config)
    n_teacher = teacher_config.num_hidden_layers
    for key, value in teacher_config.to_dict().items():
        # Per-layer lists (layer_types, sliding-window patterns, ...) follow the kept layers.
        if isinstance(value, list) and len(value) == n_teacher and key != "architectures":
            setattr(config, key, [value[i] for i in kept])
    config.num_hidden_layers = len(kept)
    if mlp_ratio < 1.0:
        config.intermediate_size = max(1, round(teacher_config.intermediate_size * mlp_ratio))
    return config


def mlp_channels(layer: nn.Module, mlp_in: tuple[str, ...], mlp_out: tuple[str, ...], keep: int) -> torch.Tensor:
    """The `keep` MLP channels with the largest norms: product of the input rows' and output column's norms."""
    modules = dict(layer.named_modules())
    score = torch.ones(modules[mlp_in[0]].weight.shape[0], dtype=torch.float64)
    for name in mlp_in:
        score *= modules[name].weight.detach().double().norm(dim=1)  # rows: (I,)
    for name in mlp_out:
        score *= modules[name].weight.detach().double().norm(dim=0)  # columns: (I,)
    return score.topk(keep).indices.sort().values


def derive_student(teacher: nn.Module, spec: int | float | list[int] = 0.5, mlp_ratio: float = 1.0,
                   ckpt: LazyCheckpoint | None = None, channels: dict[int, torch.Tensor] | None = None
                   ) -> tuple[nn.Module, list[int]]:
    """Build the student from `teacher`: kept layers copied exactly, MLP channels selected by norm (or
    `channels`: teacher layer -> the sorted channel indices to keep, e.g. by activation importance).
    With `ckpt` (the teacher's lazy checkpoint; `teacher` its skeleton) only the tensors the student
    keeps are read from disk, in float32 as a loaded teacher holds them."""
    from transformers import AutoModelForCausalLM

    arch = arch_for(teacher)
    kept = keep_layers(teacher.config.num_hidden_layers, spec)
    config = student_config(teacher.config, kept, mlp_ratio)
    dtype = torch.float32 if ckpt is not None else next(teacher.parameters()).dtype
    student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mlp_in, mlp_out = arch.sequential[-2], arch.sequential[-1]
    prefix = arch.layers + "."
    if channels is None:
        channels = {t: _layer_channels(teacher, ckpt, f"{prefix}{t}", mlp_in, mlp_out, config.intermediate_size)
                    for t in kept} if mlp_ratio < 1.0 else {}
    source = {}  # student key -> (teacher key, teacher layer or None, name inside the layer)
    for key in student.state_dict():
        if not key.startswith(prefix):
            source[key] = (key, None, key)
            continue
        j, rest = key[len(prefix):].split(".", 1)
        source[key] = (f"{prefix}{kept[int(j)]}.{rest}", kept[int(j)], rest)
    teacher_sd = _teacher_tensors(teacher, ckpt, [name for name, _, _ in source.values()])
    state = dict(student.state_dict())  # buffers a lazy teacher does not store keep the student's own
    for key, (name, t, rest) in source.items():
        if name in teacher_sd:
            value = teacher_sd[name]
            state[key] = _select_channels(value, rest, channels[t], mlp_in, mlp_out) if t in channels else value
    student.load_state_dict(state, strict=True)
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student.eval(), kept


def _teacher_tensors(teacher: nn.Module, ckpt: LazyCheckpoint | None, names: list[str]) -> dict[str, torch.Tensor]:
    """The teacher's tensors `names`: its state_dict, or read from its lazy checkpoint (those on disk)."""
    if ckpt is None:
        return teacher.state_dict()
    return ckpt.read([n for n in names if ckpt.stored_name(n) in ckpt.tensors], torch.float32)


def _layer_channels(teacher: nn.Module, ckpt: LazyCheckpoint | None, prefix: str, mlp_in: tuple, mlp_out: tuple,
                    keep: int) -> torch.Tensor:
    """`mlp_channels` of the teacher's layer `prefix`, read from disk for the time of the scoring when lazy."""
    if ckpt is None:
        return mlp_channels(teacher.get_submodule(prefix), mlp_in, mlp_out, keep)
    try:
        return mlp_channels(ckpt.materialise(prefix, torch.float32), mlp_in, mlp_out, keep)
    finally:
        ckpt.release(prefix)


def _select_channels(value: torch.Tensor, name: str, idx: torch.Tensor, mlp_in: tuple, mlp_out: tuple) -> torch.Tensor:
    module = name.rsplit(".", 1)[0]
    if module in mlp_in:
        return value[idx].clone()  # weight rows (I, H) or bias (I,)
    if module in mlp_out and name.endswith("weight"):
        return value[:, idx].clone()  # (H, I)
    return value


def student_from_config(teacher: nn.Module, config: Any, ckpt: LazyCheckpoint | None = None
                        ) -> tuple[nn.Module, list[int] | None]:
    """A student from a config of the teacher's architecture: derived from the teacher when only
    depth/MLP width differ (weights copied; `ckpt` as in `derive_student`), otherwise randomly
    initialised (returns kept=None)."""
    from transformers import AutoModelForCausalLM

    t = teacher.config
    if config.model_type != t.model_type:
        raise InputError(f"student_config is a '{config.model_type}' model; the teacher is '{t.model_type}' "
                         "(the student must have the teacher's architecture)")
    if config.vocab_size != t.vocab_size:
        raise InputError(f"student_config has vocab_size {config.vocab_size}, the teacher {t.vocab_size}: "
                         "distillation needs the same tokenizer")
    same = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    if all(getattr(config, k, None) == getattr(t, k, None) for k in same) and config.num_hidden_layers <= t.num_hidden_layers:
        ratio = min(1.0, config.intermediate_size / t.intermediate_size)
        return derive_student(teacher, keep_layers(t.num_hidden_layers, config.num_hidden_layers / t.num_hidden_layers), ratio,
                              ckpt)
    dtype = torch.float32 if ckpt is not None else next(teacher.parameters()).dtype
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), None


def check_tokenizers(teacher_tok: Any, student_tok: Any, teacher: nn.Module, student: nn.Module, where: str) -> None:
    """Distillation compares logits token by token: both models must share one vocabulary."""
    t_vocab, s_vocab = teacher_tok.get_vocab(), student_tok.get_vocab()
    if t_vocab != s_vocab:
        differ = len(set(t_vocab.items()) ^ set(s_vocab.items()))
        raise InputError(f"student {where} has a different tokenizer from the teacher's ({len(s_vocab)} vs "
                         f"{len(t_vocab)} tokens, {differ} entries differ): distillation needs the same tokenizer")
    t_out, s_out = teacher.get_output_embeddings(), student.get_output_embeddings()
    if t_out.weight.shape[0] != s_out.weight.shape[0]:
        raise InputError(f"student {where} predicts {s_out.weight.shape[0]} logits, the teacher "
                         f"{t_out.weight.shape[0]}: distillation needs the same vocabulary")


def n_params(model: nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def remembered_kept(student_dir: Path | None, teacher: nn.Module, student: nn.Module) -> list[int] | None:
    """The teacher layers a student directory written by `distill` kept (its report.json's `kept_layers`, from
    the cut or carried from the student it was trained from), when that report was made with a teacher of
    this one's size and names as many layers as the student has; else None. A student loaded again then keeps
    its derived layer map for hidden-state losses (boundary_mapped), not an evenly spaced one."""
    import json

    report = (student_dir / "report.json") if student_dir is not None else None
    if report is None or not report.is_file():
        return None
    try:
        stages = json.loads(report.read_text()).get("stages", [])
    except (OSError, ValueError, AttributeError):
        return None
    n_t, n_s, t_params = teacher.config.num_hidden_layers, student.config.num_hidden_layers, n_params(teacher)
    for stage in reversed(stages if isinstance(stages, list) else []):
        result = stage.get("result") if isinstance(stage, dict) else None
        kept = result.get("kept_layers") if isinstance(result, dict) else None
        if (isinstance(kept, list) and len(kept) == n_s and all(isinstance(i, int) for i in kept)
                and kept == sorted(set(kept)) and 0 <= kept[0] and kept[-1] < n_t
                and result.get("teacher_params") == t_params):
            return kept
    return None
