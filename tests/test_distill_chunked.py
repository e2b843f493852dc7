"""The chunked head of distillation (distill/chunked_head.py): the same losses as the whole-logits loop it
replaced, step for step, and no (batch, window, vocabulary) tensor at any point of a step."""

import pytest
import torch
from tiny import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from geminicompress.distill import train as T
from geminicompress.distill.losses import distill_loss
from geminicompress.distill.student import derive_student
from geminicompress.distill.topk_cache import build_topk_cache
from geminicompress.distill.train import Guides, TrainRun, train
from geminicompress.distill.config import DistillStage

CPU = torch.device("cpu")
VOCAB, B, SEQ = 4096, 4, 32  # a vocabulary large beside the width (64), so a (B, T, V) tensor is the biggest
CHUNK_MB = 1.25  # 32 positions per chunk (the least; the budget alone would give 10): 4 per micro-batch of 128

pytestmark = pytest.mark.usefixtures("one_thread")


def _models(tie: bool = False, kind: str = "llama"):
    teacher = tiny_model(kind, num_hidden_layers=4, vocab_size=VOCAB, tie_word_embeddings=tie)
    return teacher, derive_student(teacher, 0.5)[0]


def _windows(n=14):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))


def _cfg(**kw):
    base = dict(type="distill", steps=20, seq_len=SEQ, batch_size=B, lr=3e-3, warmup_steps=2, eval_every=20,
                eval_windows=2, precision="no", head_chunk_mb=CHUNK_MB)
    return DistillStage(**{**base, **kw})


def _whole_logits_micro_loss(loop, raw, ids, idx):
    """The loop before the chunked head: whole (B, T, V) logits of teacher and student, losses.distill_loss."""
    acc, cfg, cache = loop.acc, loop.cfg, loop.guides.cache
    with torch.no_grad(), acc.autocast():
        t_logits = cache.get(idx, acc.device) if cache is not None else loop.teacher(ids).logits
    with acc.autocast():
        s_out = loop.student(ids)
        loss, terms = distill_loss(cfg.loss, cfg.temperature, ids, s_out.logits, t_logits)
        acc.backward(loss / cfg.grad_accum)
    return float(loss.detach()), terms


def _both(tmp_path, monkeypatch, cfg, tie=False, kind="llama", cache=False):
    """The losses of the same run with the chunked head and with the whole logits."""
    runs = []
    for whole in (False, True):
        teacher, student = _models(tie, kind)
        w = _windows()
        guides = Guides(cache=build_topk_cache(teacher, w[:-2], 64, CPU, root=tmp_path / "topk") if cache else None)
        with monkeypatch.context() as m:
            if whole:
                m.setattr(T, "_micro_loss", _whole_logits_micro_loss)
            _, h = train(student, teacher, w[:-2], w[-2:], cfg, TrainRun(0, tmp_path / str(whole), CPU), guides)
        runs.append(h)
    return runs


@pytest.mark.parametrize("loss, temperature, tie, kind", [
    ({"kl": 1.0, "ce": 0.5}, 1.0, False, "llama"),  # the defaults
    ({"kl": 1.0, "ce": 0.5}, 1.0, True, "llama"),  # a tied head: its gradient meets the embedding's
    ({"kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5, "ce": 0.2}, 2.0, False, "llama"),
    ({"kl": 1.0, "ce": 0.5}, 1.0, True, "gemma"),  # Gemma's own head after its decoder
])
def test_twenty_steps_lose_what_the_whole_logits_lose_in_float32(tmp_path, monkeypatch, loss, temperature, tie, kind):
    chunked, whole = _both(tmp_path, monkeypatch, _cfg(loss=loss, temperature=temperature), tie, kind)
    assert len(chunked.loss) == len(whole.loss) == 20
    rel = [abs(a - b) / abs(b) for a, b in zip(chunked.loss, whole.loss)]
    assert max(rel) < 1e-5, rel
    assert chunked.terms[-1].keys() == whole.terms[-1].keys()
    assert chunked.loss[-1] < 0.9 * chunked.loss[0]  # and it trains


def test_the_topk_cache_loses_the_same_with_grad_accum(tmp_path, monkeypatch):
    loss = {"kl": 1.0, "reverse_kl": 0.5, "jsd": 0.5, "ce": 0.5}
    chunked, whole = _both(tmp_path, monkeypatch, _cfg(steps=8, grad_accum=2, topk_cache=64, loss=loss), cache=True)
    assert max(abs(a - b) / abs(b) for a, b in zip(chunked.loss, whole.loss)) < 1e-5


@pytest.mark.parametrize("chunk_mb, tolerance", [(CHUNK_MB, 1e-5), (0.3, 2e-3)])
def test_bf16_stays_within_bf16s_rounding_of_the_whole_logits(tmp_path, monkeypatch, chunk_mb, tolerance):
    """bf16 autocast: the products are the whole-logits loop's, so the first step's loss is the same. The head's
    weight gradient is one bf16 product when its gathered output gradients hold the micro-batch (1.25 MB: 160 of
    128 positions): the same as the whole logits' (measured 1.5e-7 relative over 20 steps); with 0.3 MB it is a
    float32 sum of 4 bf16 products (38 positions each), which parts the runs below bf16's resolution (2^-8 = 0.4%):
    measured 4.9e-4 at most over 20 steps."""
    chunked, whole = _both(tmp_path, monkeypatch, _cfg(precision="bf16", head_chunk_mb=chunk_mb))
    rel = [abs(a - b) / abs(b) for a, b in zip(chunked.loss, whole.loss)]
    assert rel[0] < 1e-6 and max(rel) < tolerance, rel


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op makes (forward and backward), and the largest over the vocabulary that is
    not a weight's (V, 64)."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.logits = 0, None, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
            if VOCAB in t.shape and 64 not in t.shape and t.numel() > torch.Size(self.logits).numel():
                self.logits = tuple(t.shape)
        return out


@pytest.mark.parametrize("loss", [{"kl": 1.0, "ce": 0.5}, {"kl": 0.0, "jsd": 1.0, "hidden_mse": 1.0}])
def test_no_step_makes_a_tensor_of_the_whole_logits(tmp_path, monkeypatch, loss):
    seen = _Largest()
    step = T._optimizer_step

    def watched(loop, i):
        with seen:
            return step(loop, i)

    monkeypatch.setattr(T, "_optimizer_step", watched)
    teacher, student = _models()
    w = _windows()
    layer_map = {0: 1, 1: 3} if "hidden_mse" in loss else None
    train(student, teacher, w[:-2], w[-2:], _cfg(steps=2, loss=loss), TrainRun(0, tmp_path, CPU), Guides(layer_map))
    rows, group = T.chunk_rows(VOCAB, CHUNK_MB), T.group_rows(VOCAB, CHUNK_MB, 4)
    assert (rows, group) == (32, 80)  # a chunk's loss holds 8 float32 (32, V); the gathered gradients are (80, V)
    # over the vocabulary: at most the gathered output gradients of the weight's gradient, never B x T = 128 positions
    assert seen.logits == (group, VOCAB) and seen.numel == group * VOCAB, (seen.logits, seen.shape)


def test_checkpointed_layers_lose_the_same(tmp_path):
    runs = []
    for checkpoint in (False, True):
        teacher, student = _models()
        w = _windows()
        _, h = train(student, teacher, w[:-2], w[-2:], _cfg(steps=4, gradient_checkpointing=checkpoint),
                     TrainRun(0, tmp_path / str(checkpoint), CPU))
        runs.append(h)
    assert max(abs(a - b) / abs(b) for a, b in zip(runs[0].loss, runs[1].loss)) < 1e-6
    assert runs[1].memory["activations"] < runs[0].memory["activations"] / 2  # only the layers' inputs are kept


def test_the_memory_report_counts_models_gradients_and_optimizer(tmp_path):
    teacher, student = _models()
    w = _windows()
    n_student = sum(p.numel() for p in student.parameters())
    n_teacher = sum(p.numel() for p in teacher.parameters())
    _, h = train(student, teacher, w[:-2], w[-2:], _cfg(steps=1), TrainRun(0, tmp_path, CPU))
    m = h.memory
    assert m["student"] >= 4 * n_student and m["teacher"] >= 4 * n_teacher  # + buffers (rotary frequencies)
    assert m["gradients"] == 4 * n_student
    assert 8 * n_student <= m["optimizer"] < 8 * n_student + 4096  # AdamW: two moments, and a step per tensor
    assert (m["head_rows"], m["head_group_rows"]) == (32, 80)
    assert m["head"] == 4 * (32 * VOCAB * 8 + B * SEQ * 64 + 80 * VOCAB + VOCAB * 64)  # float32: no cast copies
    assert 0 < m["activations"] < 4 * B * SEQ * VOCAB  # measured; less than the whole logits would be alone
    assert m["peak_rss"] > m["student"] + m["teacher"]
