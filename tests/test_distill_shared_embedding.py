"""The student's untied input embedding, frozen and held once with the teacher (distill/shared_embedding.py): no
gradient and no optimizer state for it, the teacher's table untouched, and the student's own copy after training."""

import json

import pytest
import torch
from tiny import save_tiny, tiny_model
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.distill.config import DistillStage
from geminicompress.distill.shared_embedding import own_input_embedding, share_input_embedding
from geminicompress.distill.student import derive_student
from geminicompress.distill.train import TrainRun, train

CPU = torch.device("cpu")
VOCAB = 512
FAST = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--eval-every", "3", "--warmup-steps", "1", "--quiet"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(tie=False):
    teacher = tiny_model("llama", num_hidden_layers=4, vocab_size=VOCAB, tie_word_embeddings=tie)
    return teacher, derive_student(teacher, 0.5)[0]


def test_an_untied_table_equal_to_the_teachers_is_shared_and_frozen():
    teacher, student = _pair()
    assert share_input_embedding(student, teacher)
    assert student.get_input_embeddings() is teacher.get_input_embeddings()
    assert not student.get_input_embeddings().weight.requires_grad
    assert student.get_output_embeddings().weight.requires_grad  # the head still trains


@pytest.mark.parametrize("derived", [True, False])
def test_a_streamed_teacher_freezes_the_table_of_a_student_cut_from_it(derived):
    teacher, student = _pair()
    teacher.to("meta")  # a streamed teacher's skeleton: nothing to share
    assert share_input_embedding(student, teacher, derived=derived) == derived
    assert student.get_input_embeddings() is not teacher.get_input_embeddings()
    assert student.get_input_embeddings().weight.requires_grad == (not derived)


@pytest.mark.parametrize("case", ["tied", "other values", "no teacher"])
def test_a_tied_or_foreign_table_trains(case):
    teacher, student = _pair(tie=case == "tied")
    if case == "other values":
        with torch.no_grad():
            student.get_input_embeddings().weight[3] += 1.0
    assert not share_input_embedding(student, None if case == "no teacher" else teacher)
    assert student.get_input_embeddings() is not teacher.get_input_embeddings()
    assert student.get_input_embeddings().weight.requires_grad


def test_training_holds_no_gradient_or_optimizer_state_for_the_shared_table(tmp_path):
    windows = torch.randint(0, VOCAB, (10, 32), generator=torch.Generator().manual_seed(0))
    cfg = DistillStage(type="distill", steps=4, seq_len=32, batch_size=2, warmup_steps=1, eval_every=4,
                       precision="no", lr=3e-3)
    runs = {}
    for shared in (False, True):
        teacher, student = _pair()
        before = teacher.get_input_embeddings().weight.detach().clone()
        if shared:
            assert share_input_embedding(student, teacher)
        raw, history = train(student, teacher, windows[:-2], windows[-2:], cfg, TrainRun(0, tmp_path / str(shared), CPU))
        runs[shared] = (raw, history, before, teacher)
    table_bytes = VOCAB * 64 * 4
    raw, h, before, teacher = runs[True]
    assert torch.equal(raw.get_input_embeddings().weight, before)  # frozen ...
    assert torch.equal(teacher.get_input_embeddings().weight, before)  # ... and the teacher's untouched
    other = runs[False][1]
    assert not torch.equal(runs[False][0].get_input_embeddings().weight, runs[False][2])  # trained otherwise
    assert other.memory["optimizer"] - h.memory["optimizer"] == 2 * table_bytes + 4  # AdamW's moments, its step
    assert other.memory["gradients"] - h.memory["gradients"] == table_bytes
    assert other.memory["student"] - h.memory["student"] == table_bytes  # held once, counted with the teacher
    assert h.loss[-1] < h.loss[0]  # and it trains


def test_the_student_gets_its_own_copy_back():
    teacher, student = _pair()
    share_input_embedding(student, teacher)
    own_input_embedding(student)
    mine, theirs = student.get_input_embeddings(), teacher.get_input_embeddings()
    assert mine is not theirs and mine.weight.data_ptr() != theirs.weight.data_ptr()
    assert torch.equal(mine.weight, theirs.weight) and mine.weight.requires_grad


def test_train_embedding_trains_the_untied_table(tmp_path, text_file):
    """(The default run, the table kept as the teacher's, is test_distill_cli's first test.)"""
    teacher_dir = save_tiny(tmp_path / "t4", num_hidden_layers=4)
    table = AutoModelForCausalLM.from_pretrained(teacher_dir).get_input_embeddings().weight
    out = tmp_path / "trained"
    res = CliRunner().invoke(app, ["distill", "--teacher", str(teacher_dir), "-o", str(out), "--data", str(text_file),
                                   *FAST, "--train-embedding"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    assert result["embedding"] == "trained"
    assert not torch.equal(AutoModelForCausalLM.from_pretrained(out).get_input_embeddings().weight, table)
