"""Distillation losses: pure functions of logits and hidden states, averaged over tokens.

- Forward KL(p_T || q_S) on temperature-softened distributions, scaled by T^2 so its gradient keeps
  the same magnitude as the temperature changes (Hinton, Vinyals & Dean, 2015, "Distilling the
  knowledge in a neural network"). Gradient w.r.t. the student's logits z: T * (q - p) / N.
- Reverse KL(q_S || p_T) (mode seeking, MiniLLM) and the Jensen-Shannon divergence, also x T^2.
- Cross-entropy on the data (next token), at temperature 1.
- Hidden-state MSE (normalised by the teacher's mean square, so the weight does not depend on the
  model's activation scale) and cosine distance on a student -> teacher layer map.

Training takes them a chunk of positions at a time (`chunk_terms`, driven by chunked_head.py): each chunk's
share of the whole mean, so the sum over the chunks is `distill_loss`'s value without (B, T, V) logits.
The teacher may be given as dense logits (B, T, V) or as a cached top-k `SparseLogits`; then the KL
terms are computed on the top-k support (teacher renormalised over its k tokens; forward KL uses the
student's full-vocabulary log-probabilities gathered there, reverse KL and JSD renormalise the student
over the same support).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from geminicompress.distill.config import LossWeights


@dataclass
class SparseLogits:
    """The teacher's top-k logits per position: values and vocabulary indices, both (B, T, k)."""

    values: torch.Tensor
    indices: torch.Tensor


Teacher = torch.Tensor | SparseLogits


def _log_probs(student: torch.Tensor, teacher: Teacher, temperature: float, renormalise: bool):
    """(student log q, teacher log p) on the same support, float32, shape (..., V) or (..., k)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    if isinstance(teacher, torch.Tensor):
        return s, F.log_softmax(teacher.float() / temperature, dim=-1)
    s = s.gather(-1, teacher.indices.long())
    if renormalise:
        s = s - s.logsumexp(-1, keepdim=True)
    return s, F.log_softmax(teacher.values.float() / temperature, dim=-1)


def forward_kl(student: torch.Tensor, teacher: Teacher, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * mean over tokens of sum_v p(v) (log p(v) - log q(v))."""
    s, t = _log_probs(student, teacher, temperature, renormalise=False)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature**2


def reverse_kl(student: torch.Tensor, teacher: Teacher, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * mean over tokens of sum_v q(v) (log q(v) - log p(v))."""
    s, t = _log_probs(student, teacher, temperature, renormalise=True)
    return (s.exp() * (s - t)).sum(-1).mean() * temperature**2


def jsd(student: torch.Tensor, teacher: Teacher, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * mean over tokens of (KL(p || m) + KL(q || m)) / 2, with m = (p + q) / 2."""
    s, t = _log_probs(student, teacher, temperature, renormalise=True)
    m = torch.logaddexp(s, t) - torch.log(torch.tensor(2.0, device=s.device))
    kl_pm = (t.exp() * (t - m)).sum(-1)
    kl_qm = (s.exp() * (s - m)).sum(-1)
    return 0.5 * (kl_pm + kl_qm).mean() * temperature**2


def cross_entropy(student: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits (B, T, V) at positions 0..T-2 predict ids 1..T-1."""
    return F.cross_entropy(student[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


IGNORE = -100  # the target of a window's last position: it predicts nothing inside the window


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B·T,): the token each position predicts, IGNORE at each window's last position."""
    targets = input_ids.roll(-1, dims=1)
    targets[:, -1] = IGNORE
    return targets.flatten()


LOGIT_TERMS = (("kl", forward_kl), ("reverse_kl", reverse_kl), ("jsd", jsd))


def chunk_terms(weights: LossWeights, temperature: float, student: torch.Tensor, teacher: Teacher | None,
                targets: torch.Tensor, counts: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Each enabled logit term's share from c of the batch's positions: student logits (c, V), the teacher's (c, V)
    or top-k (c, k), targets (c,). `counts`: (positions N, positions with a target) of the whole batch. Summed over
    chunks that cover the batch, the terms are distill_loss's (forward_kl ... cross_entropy, means over the batch)."""
    share = student.shape[0] / counts[0]
    terms = {name: fn(student, teacher, temperature) * share
             for name, fn in LOGIT_TERMS if getattr(weights, name) > 0}
    if weights.ce > 0:
        terms["ce"] = F.cross_entropy(student.float(), targets, ignore_index=IGNORE, reduction="sum") / counts[1]
    return terms


def hidden_terms(weights: LossWeights, student_hidden: tuple[torch.Tensor, ...] | None,
                 teacher_hidden: tuple[torch.Tensor, ...] | None, layer_map: dict[int, int] | None) -> dict[str, torch.Tensor]:
    """hidden_mse and hidden_cos (those enabled), each averaged over the layer map's pairs. Hidden states are the
    models' `output_hidden_states` tuples: index l + 1 is decoder layer l's output."""
    terms: dict[str, torch.Tensor] = {}
    for name, fn in (("hidden_mse", hidden_mse), ("hidden_cos", hidden_cos)):
        if getattr(weights, name) > 0:
            pairs = [(student_hidden[s + 1], teacher_hidden[t + 1]) for s, t in layer_map.items()]
            terms[name] = torch.stack([fn(a, b) for a, b in pairs]).mean()
    return terms


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared error of hidden states (B, T, H), divided by the teacher's mean square."""
    teacher = teacher.float()
    return F.mse_loss(student.float(), teacher) / teacher.pow(2).mean().clamp_min(1e-12)


def hidden_cos(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity of hidden states, averaged over tokens."""
    return (1.0 - F.cosine_similarity(student.float(), teacher.float(), dim=-1)).mean()


def distill_loss(
    weights: LossWeights,
    temperature: float,
    input_ids: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: Teacher | None,
    student_hidden: tuple[torch.Tensor, ...] | None = None,
    teacher_hidden: tuple[torch.Tensor, ...] | None = None,
    layer_map: dict[int, int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of the enabled losses, and each term's value (for the log).

    Hidden states are the models' `output_hidden_states` tuples: index l + 1 is decoder layer l's output.
    """
    terms: dict[str, torch.Tensor] = {}
    for name, fn in LOGIT_TERMS:
        if getattr(weights, name) > 0:
            terms[name] = fn(student_logits, teacher_logits, temperature)
    if weights.ce > 0:
        terms["ce"] = cross_entropy(student_logits, input_ids)
    terms.update(hidden_terms(weights, student_hidden, teacher_hidden, layer_map))
    total = sum(getattr(weights, name) * value for name, value in terms.items())
    return total, {name: float(value.detach()) for name, value in terms.items()}
