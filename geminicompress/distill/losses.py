"""Distillation losses: pure functions of logits and hidden states, averaged over tokens.

- Forward KL(p_T || q_S) on temperature-softened distributions, scaled by T^2 so its gradient keeps
  the same magnitude as the temperature changes (Hinton, Vinyals & Dean, 2015, "Distilling the
  knowledge in a neural network"). Gradient w.r.t. the student's logits z: T * (q - p) / N.
- Reverse KL(q_S || p_T) (mode seeking, MiniLLM) and the Jensen-Shannon divergence, also x T^2.
- Cross-entropy on the data (next token), at temperature 1.
- Hidden-state MSE (normalised by the teacher's mean square, so the weight does not depend on the
  model's activation scale) and cosine distance on a student -> teacher layer map.

The teacher may be given as dense logits (B, T, V) or as a cached top-k `SparseLogits`; then the KL
terms are computed on the top-k support (teacher renormalised over its k tokens; forward KL uses the
student's full-vocabulary log-probabilities gathered there, reverse KL and JSD renormalise the student
over the same support).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from geminicompress.recipes.schema import LossWeights


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
    for name, fn in (("kl", forward_kl), ("reverse_kl", reverse_kl), ("jsd", jsd)):
        if getattr(weights, name) > 0:
            terms[name] = fn(student_logits, teacher_logits, temperature)
    if weights.ce > 0:
        terms["ce"] = cross_entropy(student_logits, input_ids)
    for name, fn in (("hidden_mse", hidden_mse), ("hidden_cos", hidden_cos)):
        if getattr(weights, name) > 0:
            pairs = [(student_hidden[s + 1], teacher_hidden[t + 1]) for s, t in layer_map.items()]
            terms[name] = torch.stack([fn(a, b) for a, b in pairs]).mean()
    total = sum(getattr(weights, name) * value for name, value in terms.items())
    return total, {name: float(value.detach()) for name, value in terms.items()}
