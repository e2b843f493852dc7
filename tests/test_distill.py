"""Student construction, the training loop (loss goes down, exact resume), sparse recovery."""

import copy

import pytest
import torch
from tiny import prune_in_place, tiny_model

from geminicompress.distill.masks import apply_masks, check_masks, masks_from_zeros
from geminicompress.distill.student import boundary_mapped, derive_student, evenly_mapped, keep_layers, student_config
from geminicompress.distill.train import Guides, TrainRun, batch_indices, train
from geminicompress.core.errors import InputError
from geminicompress.formats.masks import read_masks, write_masks
from geminicompress.distill.config import DistillStage

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw):
    base = dict(type="distill", steps=6, seq_len=32, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=3,
                eval_windows=2)
    return DistillStage(**{**base, **kw})


def _windows(n=18, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n, t), generator=g)


def test_keep_layers_every_other_with_first_and_last():
    assert keep_layers(30, 0.5) == [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29]
    assert keep_layers(4, 0.5) == [0, 3]
    assert keep_layers(5, 1.0) == [0, 1, 2, 3, 4]
    assert keep_layers(6, [4, 0, -1]) == [0, 4, 5]


def test_layer_list_out_of_range_is_one_clear_line():
    with pytest.raises(InputError, match=r"layer 6 is out of range for a teacher with 6 layers \(use 0..5\)") as e:
        keep_layers(6, [0, 6])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt_neox"])
def test_student_keeps_the_right_layers_with_exact_weights(kind):
    teacher = tiny_model(kind, num_hidden_layers=6)
    student, kept = derive_student(teacher, [0, 2, 5])
    assert kept == [0, 2, 5] and student.config.num_hidden_layers == 3
    assert type(student) is type(teacher)
    layers_path = "gpt_neox.layers" if kind == "gpt_neox" else "model.layers"
    t_sd, s_sd = teacher.state_dict(), student.state_dict()
    for key, value in s_sd.items():
        if key.startswith(layers_path + "."):
            j, rest = key[len(layers_path) + 1:].split(".", 1)
            key_t = f"{layers_path}.{kept[int(j)]}.{rest}"
        else:
            key_t = key
        assert torch.equal(value, t_sd[key_t]), key
    # the student computes exactly what the teacher's kept layers compute
    ids = torch.randint(0, 384, (1, 10))
    with torch.no_grad():
        out = student(ids).logits
    assert torch.isfinite(out).all()


def test_student_with_all_layers_reproduces_the_teacher():
    teacher = tiny_model(num_hidden_layers=3)
    student, _ = derive_student(teacher, 1.0)
    ids = torch.randint(0, 384, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits)


def test_narrower_mlp_keeps_the_largest_channels():
    teacher = tiny_model(num_hidden_layers=2)
    mlp = teacher.model.layers[1].mlp
    with torch.no_grad():
        mlp.down_proj.weight[:, 7] *= 50  # channel 7 dominates
    student, _ = derive_student(teacher, 1.0, mlp_ratio=0.25)
    assert student.config.intermediate_size == 32
    s_mlp = student.model.layers[1].mlp
    t_rows = {tuple(r.tolist()) for r in mlp.gate_proj.weight}
    assert all(tuple(r.tolist()) in t_rows for r in s_mlp.gate_proj.weight)
    assert any(torch.equal(r, mlp.gate_proj.weight[7]) for r in s_mlp.gate_proj.weight)


def test_per_layer_config_lists_follow_the_kept_layers():
    teacher = tiny_model("qwen2", num_hidden_layers=4)
    teacher.config.layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = student_config(teacher.config, [1, 2])
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.num_hidden_layers == 2


def test_batch_order_is_a_function_of_the_step():
    a = [batch_indices(m, 10, 3, seed=0).tolist() for m in range(7)]
    b = [batch_indices(m, 10, 3, seed=0).tolist() for m in range(7)]
    assert a == b
    first_epoch = sorted(i for batch in a[:3] for i in batch) + a[3][:1]
    assert sorted(first_epoch) == list(range(10))  # every window once per epoch
    ranks = [batch_indices(2, 100, 4, seed=0, rank=r, world=2).tolist() for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])


def test_a_few_steps_reduce_the_loss(tmp_path):
    teacher = tiny_model(num_hidden_layers=4)
    student, _ = derive_student(teacher, 0.5)
    w = _windows()
    _, h = train(student, teacher, w[:4], w[16:], _cfg(steps=12, eval_every=12), TrainRun(0, tmp_path, CPU))
    assert h.step == 12 and h.tokens == 12 * 2 * 32
    assert sum(h.loss[-3:]) / 3 < 0.7 * sum(h.loss[:3]) / 3


def test_ce_and_hidden_losses_train(tmp_path):
    teacher = tiny_model(num_hidden_layers=4)
    student, kept = derive_student(teacher, 0.5)
    cfg = _cfg(steps=8, loss={"kl": 1.0, "ce": 0.5, "hidden_mse": 1.0, "hidden_cos": 1.0})
    w = _windows()
    _, h = train(student, teacher, w[:4], w[16:], cfg, TrainRun(0, tmp_path, CPU),
                 Guides(layer_map=dict(enumerate(kept))))
    assert set(h.terms[0]) == {"kl", "ce", "hidden_mse", "hidden_cos"}
    assert h.loss[-1] < h.loss[0]


class _StopAt:
    """A progress whose bar interrupts the run after `n` steps (like Ctrl-C)."""

    def __init__(self, n):
        self.n, self.done = n, 0

    def task(self, description, total):
        from contextlib import contextmanager

        outer = self

        class Bar:
            def advance(self, k=1, **fields):
                outer.done += k
                if outer.done >= outer.n:
                    raise KeyboardInterrupt

        @contextmanager
        def cm():
            yield Bar()

        return cm()

    def info(self, message):
        pass

    def warn(self, message):
        pass


def test_resume_continues_the_same_loss_trajectory(tmp_path):
    teacher = tiny_model(num_hidden_layers=4)
    student, _ = derive_student(teacher, 0.5)
    w = _windows()
    cfg = _cfg(steps=6, save_every=3, grad_accum=2)
    ref_student = copy.deepcopy(student)
    _, ref = train(ref_student, teacher, w[:10], w[16:], cfg, TrainRun(0, tmp_path / "a", CPU))

    first = copy.deepcopy(student)
    with pytest.raises(KeyboardInterrupt):
        train(first, teacher, w[:10], w[16:], cfg, TrainRun(0, tmp_path / "b", CPU, _StopAt(4)))  # dies during step 4, after the step-3 checkpoint
    resumed_student, resumed = train(copy.deepcopy(student), teacher, w[:10], w[16:], cfg.model_copy(update={"resume": True}),
                                     TrainRun(0, tmp_path / "b", CPU))
    assert resumed.step == 6 and len(resumed.loss) == 6
    torch.testing.assert_close(torch.tensor(resumed.loss), torch.tensor(ref.loss), rtol=1e-6, atol=1e-7)
    assert [step for step, _ in resumed.ppl] == [step for step, _ in ref.ppl]
    assert [ppl for _, ppl in resumed.ppl] == pytest.approx([ppl for _, ppl in ref.ppl], rel=1e-6)
    for (n, a), b in zip(ref_student.named_parameters(), resumed_student.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)


def _pruned_tiny(fraction=0.5):
    model = tiny_model(num_hidden_layers=2)
    return model, prune_in_place(model, fraction)


def test_masks_survive_training(tmp_path):
    teacher = tiny_model(num_hidden_layers=2)
    student, masks = _pruned_tiny()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trained, h = train(student, teacher, _windows()[:8], _windows()[16:], _cfg(steps=5, weight_decay=0.1),
                       TrainRun(0, tmp_path, CPU), Guides(masks=masks))
    params = dict(trained.named_parameters())
    for name, mask in masks.items():
        assert torch.all(params[name][~mask] == 0), name
        assert not torch.equal(params[name], before[name]), name  # the kept weights did train
    assert h.loss[-1] < h.loss[0]


def test_masks_round_trip_and_inference(tmp_path):
    student, masks = _pruned_tiny()
    write_masks(masks, tmp_path)
    back = read_masks(tmp_path)
    assert set(back) == set(masks) and all(torch.equal(back[k], masks[k]) for k in masks)
    inferred = masks_from_zeros(student)
    assert set(inferred) == set(masks) and all(torch.equal(inferred[k], masks[k]) for k in masks)
    assert masks_from_zeros(tiny_model()) is None
    with pytest.raises(InputError, match="names no parameter"):
        check_masks(student, {"nope.weight": torch.ones(2)})
    dense = tiny_model(num_hidden_layers=2)
    apply_masks(dense, masks)
    assert all(torch.all(dict(dense.named_parameters())[k][~m] == 0) for k, m in masks.items())


def test_hidden_losses_map_each_student_layer_to_what_its_next_layer_reads():
    kept = list(range(13)) + list(range(19, 30))  # 13-18 of 30 dropped
    m = boundary_mapped(kept, 30)
    assert m[11] == 11 and m[12] == 18 and m[13] == 19 and m[23] == 29 and len(m) == 24
    assert boundary_mapped([0, 2, 4, 5], 6) == {0: 1, 1: 3, 2: 4, 3: 5}
    assert boundary_mapped([1, 3], 6) == {0: 2, 1: 5}  # the last always the teacher's last
    assert evenly_mapped(2, 6) == {0: 2, 1: 5}  # a student not derived: the same convention, evenly spaced
