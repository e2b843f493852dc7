"""The shared prefix (distill/shared_prefix.py): the student's leading blocks that are the teacher's own are
found exactly, frozen, and skipped: a forward from the teacher's hidden state gives the student's logits."""

import copy

import pytest
import torch
from tiny import tiny_model

from geminicompress.core.arch import decoder_layers
from geminicompress.distill.shared_prefix import TeacherInput, prefix_length, starting_at
from geminicompress.distill.student import derive_student
from geminicompress.distill.train import TrainRun, train
from geminicompress.distill.config import DistillStage

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _windows(n=12, t=24, seed=0):
    return torch.randint(0, 384, (n, t), generator=torch.Generator().manual_seed(seed))


def test_prefix_length_counts_the_blocks_equal_to_the_teachers():
    teacher = tiny_model(num_hidden_layers=6)
    student, _ = derive_student(teacher, [0, 1, 2, 4, 5])
    assert prefix_length(student, teacher) == 3
    with torch.no_grad():
        student.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one changed weight ends the prefix
    assert prefix_length(student, teacher) == 1
    with torch.no_grad():
        student.model.embed_tokens.weight[5, 0] += 1e-3  # another embedding: nothing is shared
    assert prefix_length(student, teacher) == 0
    same = copy.deepcopy(teacher)
    assert prefix_length(same, teacher) == 5  # a copy: all but the last block (one block always trains)


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt_neox"])
def test_a_forward_from_the_teachers_state_gives_the_students_logits(kind):
    teacher = tiny_model(kind, num_hidden_layers=5).eval()
    student, _ = derive_student(teacher, [0, 1, 3, 4])
    student.eval()
    k = prefix_length(student, teacher)
    assert k == 2
    ids = _windows(2, 24)
    capture = TeacherInput(teacher, k)
    with torch.no_grad():
        teacher(ids)
        plain = student(ids).logits
        with starting_at(student, k, capture.take()):
            shared = student(ids).logits
    capture.close()
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    assert all("forward" not in vars(layer) for layer in decoder_layers(student))  # the stubs are gone


def test_training_with_a_frozen_prefix_keeps_it_and_its_tied_embedding(tmp_path):
    teacher = tiny_model(num_hidden_layers=6, tie_word_embeddings=True)
    student, _ = derive_student(teacher, [0, 1, 2, 4, 5])
    before = copy.deepcopy(student.state_dict())
    w = _windows()
    base = dict(type="distill", steps=4, seq_len=24, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=4,
                eval_windows=2, loss={"kl": 1.0, "ce": 0.0})  # KL alone: the random model's data CE is noise
    trained, h = train(student, teacher, w[:8], w[10:], DistillStage(**base, freeze_prefix=True),
                       TrainRun(0, tmp_path / "a", CPU))
    assert (h.frozen_prefix, h.shared_prefix) == (3, True)
    after = trained.state_dict()
    for name, value in before.items():
        frozen = name.startswith(("model.embed_tokens", "lm_head")) or any(
            name.startswith(f"model.layers.{i}.") for i in range(3))
        assert torch.equal(after[name], value) == frozen, name
    # the first step's loss (before any update) is the true loss of the whole student's forward
    _, plain = train(derive_student(teacher, [0, 1, 2, 4, 5])[0], teacher, w[:8], w[10:], DistillStage(**base),
                     TrainRun(0, tmp_path / "b", CPU))
    assert (plain.frozen_prefix, plain.shared_prefix) == (0, False)
    assert h.loss[0] == pytest.approx(plain.loss[0], rel=1e-5)
    assert h.loss[-1] < h.loss[0]


def test_a_student_trained_in_bf16_computes_in_float32_after(tmp_path):
    """accelerate wraps a mixed-precision model's forward in autocast; the trained student must not keep it
    (its written checkpoint, loaded in float32, would differ from the in-process model the export verifies)."""
    teacher = tiny_model(num_hidden_layers=4)
    student, _ = derive_student(teacher, [0, 1, 3])
    w = _windows()
    cfg = DistillStage(type="distill", steps=2, seq_len=24, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=2,
                       eval_windows=2, precision="bf16", freeze_prefix=True)
    trained, _ = train(student, teacher, w[:8], w[10:], cfg, TrainRun(0, tmp_path, CPU))
    fresh = tiny_model(num_hidden_layers=3)
    fresh.load_state_dict(trained.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(trained(w[:2]).logits, fresh.eval()(w[:2]).logits, rtol=0, atol=1e-5)
