"""The logit losses of distillation a chunk of positions at a time: no (batch, window, vocabulary) tensor.

Cut Cross-Entropy (Wijmans et al., 2024, "Cut your losses in large-vocabulary language models") and Liger
Kernel's fused linear losses take a language model's loss without its whole logits. Here the same with plain
torch ops, for every loss on the logits (forward KL, reverse KL, JSD, cross-entropy, any temperature):

1. The student's decoder runs once, its output head swapped for a stub (`head_bypassed`) that hands on what the
   head reads: the final norm's output, (B, T, d). The teacher's decoder likewise (`models.head.final_states`).
2. `chunked_logit_loss` goes over the N = B·T positions `rows` at a time. For each chunk the student's own head
   (`models.head.own_head`: the model's forward after its decoder, so soft-capping or a logit scale stay the
   model's) makes the chunk's logits (c, V), the teacher's head (or the top-k cache) the teacher's, the terms of
   losses.py are taken on them, and their gradient with respect to the chunk's hidden states and the head's
   weights is computed at once (inside the forward of a custom autograd function, as Liger does); then the
   chunk's tensors are dropped. The function's backward hands on the kept gradients, (B, T, d) and the head's
   weights, scaled by the gradient reaching the loss.

Same numbers: each chunk's terms are its positions' share of the whole mean (losses.chunk_terms), so the sum
over chunks is the unchunked loss up to the float rounding of sums and matrix products over fewer rows
(tests/test_distill_chunked.py: 20 training steps in float32 within 1e-5 of the whole-logits loss).
Memory: one chunk's logits and the loss's few temporaries of that shape, the head's gradient (V, d) and the
hidden states' (B, T, d); `chunk_rows` sizes the chunk from a byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from geminicompress.core.rows import BLOCK_BYTES, rows_within, spans
from geminicompress.distill.losses import IGNORE, Teacher, chunk_terms
from geminicompress.host.memory import release_free_heap
from geminicompress.distill.config import LossWeights

LOSS_TEMPORARIES = 8  # float32 (rows, V) tensors a chunk's loss and its gradient hold at once (KL + CE)
MIN_ROWS = 32  # positions per chunk at least: each chunk reads the head's weights three times (Gemma 3: 3 x 335 MB)


def chunk_rows(vocab: int, budget_mb: float) -> int:
    """Positions per chunk so that LOSS_TEMPORARIES float32 (rows, vocab) tensors take at most `budget_mb` MB, but
    at least MIN_ROWS (a budget below that is exceeded: 268 MB at Gemma 3's 262,144 tokens)."""
    return max(MIN_ROWS, rows_within(vocab * LOSS_TEMPORARIES, int(budget_mb * 2**20)))


def group_rows(vocab: int, budget_mb: float, itemsize: int) -> int:
    """Positions whose output gradients (rows, vocab) the weight's gradient gathers before one product: as many as
    fit `budget_mb` MB in the products' dtype, at least a chunk's."""
    return max(chunk_rows(vocab, budget_mb), rows_within(vocab, int(budget_mb * 2**20), itemsize))


class _Handoff(nn.Module):
    """Stands in for the output head during a forward: returns (and keeps) the hidden states the head reads."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden


@contextmanager
def head_bypassed(model: nn.Module) -> Iterator[_Handoff]:
    """Inside the block the CausalLM's forward skips its output head; the yielded stub's `.hidden` holds what the
    head would have read, (B, T, d), with its graph. The head module is put back on exit."""
    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stub = _Handoff()
    setattr(parent, attr, stub)
    try:
        yield stub
    finally:
        setattr(parent, attr, head)


def products_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The dtype matrix products compute in here: autocast's when it is on, else `default`."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else default


@contextmanager
def weight_as(module: nn.Module, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Inside the block `module` (a linear map) holds a frozen copy of its weight in `dtype` (yielded). Under
    autocast to `dtype` its products are the same (autocast casts the float32 weight for every call), but the cast
    is made once, not once per chunk: for Gemma 3's head, 168M weights, a cast per chunk cost as much as the
    product. The weight is put back on exit (a tied one, tied again)."""
    weight = module.weight
    if weight.dtype == dtype:
        yield weight.detach()
        return
    module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    try:
        yield module.weight
    finally:
        module.weight = weight


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of the output head (its weight, tied or not, and a bias)."""
    return [p for p in model.get_output_embeddings().parameters() if p.requires_grad]


@dataclass
class ChunkJob:
    """What the chunks of one micro-batch need: the student's head (its own forward after the decoder, and the
    module whose linear map it applies), the teacher's logits per span of positions, the targets, the loss
    weights, the chunk sizes; `terms` collects each term's value (summed over the chunks)."""

    head: Callable[[torch.Tensor], torch.Tensor]  # (1, c, d) -> (1, c, V) logits, through the student's own head
    module: nn.Module  # the output embedding (a linear map, weight (V, d)): the gradient stops at its output
    teacher: Callable[[int, int], Teacher | None]  # positions [start, stop) of the N -> (c, V) or (c, k), or None
    targets: torch.Tensor  # (N,) the next token of each position; losses.IGNORE at each window's last
    weights: LossWeights
    temperature: float
    rows: int  # positions per chunk of the loss
    group: int  # positions per product of the weight's gradient (>= rows)
    terms: dict[str, float] = field(default_factory=dict)


class _OutputAsLeaf:
    """A forward hook on the output head's linear map: its output becomes a leaf that requires grad, so that the
    gradient of a chunk's loss stops there, (c, V), whatever the model does after the map (soft-capping, a scale)."""

    def __init__(self, module: nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        self.value = out.detach().requires_grad_()
        return self.value

    def __enter__(self) -> "_OutputAsLeaf":
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


class _WeightGrad:
    """The head weight's gradient, sum over positions of g^T x: the chunks' output gradients g (c, V) and inputs
    x (c, d) are gathered, in the products' dtype, `group` positions at a time, then multiplied once per group."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group: int) -> None:
        self.grad = torch.zeros_like(weight, dtype=torch.float32)  # (V, d)
        self._g = weight.new_empty((group, weight.shape[0]), dtype=dtype)  # (group, V)
        self._x = weight.new_empty((group, weight.shape[1]), dtype=dtype)  # (group, d)
        self._n = 0

    def add(self, g: torch.Tensor, x: torch.Tensor) -> None:
        if self._n + len(g) > len(self._g):
            self.flush()
        self._g[self._n : self._n + len(g)] = g
        self._x[self._n : self._n + len(g)] = x
        self._n += len(g)

    def flush(self) -> None:
        g, x, self._n = self._g[: self._n], self._x[: self._n], 0
        for a, b in spans(len(self.grad), rows_within(self.grad.shape[1], BLOCK_BYTES)):  # a block of vocabulary rows
            if self.grad.dtype == g.dtype:
                self.grad[a:b].addmm_(g[:, a:b].t(), x)
            else:  # a product in the autocast dtype, as autograd's backward of the whole logits, added in float32
                self.grad[a:b] += g[:, a:b].t() @ x


def _chunk(job: ChunkJob, leaf: _OutputAsLeaf, h: torch.Tensor, span: tuple[int, int], n_targets: int):
    """One chunk's (loss, its terms, the gradient at the head's linear output (c, V))."""
    start, stop = span
    with torch.enable_grad():
        leaf.value = None
        logits = job.head(h.unsqueeze(0))[0]  # (c, V)
        if leaf.value is None or not isinstance(job.module, nn.Linear):
            raise RuntimeError(f"{type(job.module).__name__}: the head's logits do not come from a linear output "
                               "embedding module, which the chunked head's gradient assumes")
        terms = chunk_terms(job.weights, job.temperature, logits, job.teacher(start, stop), job.targets[start:stop],
                            (len(job.targets), n_targets))
        loss = sum(getattr(job.weights, name) * value for name, value in terms.items())
        (g,) = torch.autograd.grad(loss, leaf.value)
    return loss.detach(), terms, g[0]


class _ChunkedLoss(torch.autograd.Function):
    """forward(job, hidden (B, T, d), weight (V, d), bias or None) -> the weighted logit loss; the gradients of the
    hidden states and the head computed chunk by chunk in the forward, handed on in the backward."""

    @staticmethod
    def forward(ctx, job: ChunkJob, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        flat = hidden.detach().flatten(0, 1)  # (N, d)
        dtype = products_dtype(flat.device, weight.dtype)
        grad_h = torch.empty_like(flat) if ctx.needs_input_grad[1] else None
        grad_w = _WeightGrad(weight, dtype, job.group) if ctx.needs_input_grad[2] else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[3] else None
        total, n_targets = torch.zeros((), dtype=torch.float32, device=flat.device), int((job.targets != IGNORE).sum())
        with _OutputAsLeaf(job.module) as leaf, weight_as(job.module, dtype) as w:  # w: (V, d)
            for start, stop in spans(flat.shape[0], job.rows):
                loss, terms, g = _chunk(job, leaf, flat[start:stop], (start, stop), n_targets)  # g: (c, V)
                g, x = g.to(dtype), flat[start:stop]
                if grad_h is not None:
                    grad_h[start:stop] = g @ w  # (c, d), as the linear's backward computes it
                if grad_w is not None:
                    grad_w.add(g, x.to(dtype))
                if grad_b is not None:
                    grad_b += g.float().sum(0)
                total += loss
                release_free_heap()  # the chunk's temporaries (heap-served inside heap_reuse) back to the system
                for name, value in terms.items():
                    job.terms[name] = job.terms.get(name, 0.0) + float(value.detach())
        if grad_w is not None:
            grad_w.flush()
        ctx.grads = [grad_h.view(hidden.shape) if grad_h is not None else None,
                     grad_w.grad if grad_w is not None else None, grad_b]
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        if not bool(grad_out == 1):
            grads = [g * grad_out.to(g.dtype) if g is not None else None for g in grads]
        return (None, *grads)


def chunked_logit_loss(job: ChunkJob, hidden: torch.Tensor) -> torch.Tensor:
    """The weighted sum of the logit terms for the final hidden states (B, T, d); their values land in job.terms.
    The gradient reaches the hidden states and the head's weight and bias (job.module's)."""
    return _ChunkedLoss.apply(job, hidden, job.module.weight, getattr(job.module, "bias", None))
