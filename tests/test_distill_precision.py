"""`precision: auto` (distill/precision.py): bf16 where the device multiplies it natively, float32 elsewhere,
accelerate's configured bf16/fp16 under `accelerate launch`; the loop really computes in what was chosen,
report.json says what and why, and one process may train in two precisions one after the other."""

import pytest
import torch
from pydantic import ValidationError
from tiny import tiny_model

from geminicompress.distill import precision as P
from geminicompress.distill.student import derive_student
from geminicompress.distill.train import TrainRun, train
from geminicompress.distill.config import DistillStage

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("requested,device,native,launcher,mode", [
    ("auto", "cpu", True, None, "bf16"),
    ("auto", "cpu", False, None, "no"),
    ("auto", "cuda", True, None, "bf16"),
    ("auto", "cuda", False, None, "no"),
    ("auto", "cpu", False, "bf16", "bf16"),  # accelerate's config chose bf16: it wins (emulated: said)
    ("auto", "cuda", True, "fp16", "fp16"),
    ("auto", "cpu", True, "no", "bf16"),  # the launcher's default "no" is not a choice: the device decides
    ("no", "cpu", True, None, "no"),  # explicit: as asked, whatever the device or launcher
    ("bf16", "cpu", False, "fp16", "bf16"),  # (emulated: said, below)
    ("fp16", "cuda", True, None, "fp16"),
])
def test_auto_resolves_by_device_and_launcher_explicit_is_kept(requested, device, native, launcher, mode):
    got = P.resolve_precision(requested, device, native, launcher)
    assert got.mode == mode
    assert got.why.startswith("auto" if requested == "auto" else "as asked")
    assert got.slow == (mode == "bf16" and not native)


def test_bf16_asked_for_where_it_is_emulated_says_so():
    got = P.resolve_precision("bf16", "cpu", False)
    assert got.slow and "this CPU does not compute bf16 natively: emulated, slower than float32" in got.why
    assert not P.resolve_precision("bf16", "cpu", True).slow
    assert not P.resolve_precision("fp16", "cpu", False).slow  # fp16 autocast on a CPU: the user's call


def test_the_reason_names_the_device():
    assert P.resolve_precision("auto", "cpu", True).why == "auto: this CPU computes bf16 natively"
    assert "this GPU does not compute bf16 natively" in P.resolve_precision("auto", "cuda", False).why


def test_native_bf16_on_a_cpu_is_torchs_probe(monkeypatch):
    for avx, amx, want in [(False, False, False), (True, False, True), (False, True, True)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert P.native_bf16(CPU) is want
    assert P.native_bf16(torch.device("meta")) is False


def test_the_schema_defaults_to_auto_and_names_the_choices():
    assert DistillStage(type="distill").precision == "auto"
    with pytest.raises(ValidationError, match="'auto', 'no', 'bf16' or 'fp16'"):
        DistillStage(type="distill", precision="fp8")


def _run(tmp_path, precision, name):
    teacher = tiny_model(num_hidden_layers=4)
    student, _ = derive_student(teacher, [0, 1, 3])
    w = torch.randint(0, 384, (12, 24), generator=torch.Generator().manual_seed(0))
    cfg = DistillStage(type="distill", steps=1, seq_len=24, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=1,
                       eval_windows=2, precision=precision)
    _, history = train(student, teacher, w[:8], w[10:], cfg, TrainRun(0, tmp_path / name, CPU))
    return history


def test_auto_trains_in_what_it_resolves_to_and_one_process_switches_precision(tmp_path, monkeypatch):
    """The same step in float32 and in bf16 gives different losses; `auto` gives exactly one or the other as the
    device says, and records it. Four runs in one process, precisions alternating: accelerate's one-per-process
    state is started afresh each time (it would refuse the second precision)."""
    monkeypatch.delenv(P.LAUNCHER_ENV, raising=False)
    fp32 = _run(tmp_path, "no", "a")
    bf16 = _run(tmp_path, "bf16", "b")
    assert (fp32.precision, bf16.precision) == ("no", "bf16")
    assert fp32.loss[0] != pytest.approx(bf16.loss[0], rel=1e-4)  # bf16 autocast really ran
    monkeypatch.setattr(P, "native_bf16", lambda device: False)
    auto_no = _run(tmp_path, "auto", "c")
    monkeypatch.setattr(P, "native_bf16", lambda device: True)
    auto_bf16 = _run(tmp_path, "auto", "d")
    assert (auto_no.precision, auto_bf16.precision) == ("no", "bf16")
    assert auto_no.precision_why.startswith("auto: this CPU does not")
    assert auto_no.loss[0] == pytest.approx(fp32.loss[0], rel=1e-6)
    assert auto_bf16.loss[0] == pytest.approx(bf16.loss[0], rel=1e-6)


@pytest.mark.parametrize("kind, tie", [("llama", False), ("llama", True), ("gemma", True)])
def test_a_frozen_teacher_held_in_bf16_gives_the_same_logits_under_bf16_autocast(kind, tie):
    """frozen_linears_as: under bf16 autocast the teacher's logits are bit for bit those of its float32 weights
    (autocast casts each linear's weight anyway); a head tied to the embedding and shared tensors stay float32."""
    import copy

    from tiny import tiny_model

    from geminicompress.distill.frozen_teacher import frozen_linears_as

    torch.manual_seed(0)
    teacher = tiny_model(kind, num_hidden_layers=2, vocab_size=512, tie_word_embeddings=tie).eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = teacher(ids).logits
    shared = teacher.model.layers[0].mlp.down_proj.weight
    held = copy.deepcopy(teacher)
    linear = sum(m.weight.numel() for m in held.modules() if isinstance(m, torch.nn.Linear))
    head = held.get_output_embeddings().weight
    saved = frozen_linears_as(held, torch.bfloat16, keep=[held.model.layers[0].mlp.down_proj.weight])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = held(ids).logits
    assert torch.equal(before, after)
    kept = shared.numel() + (head.numel() if tie else 0)
    assert saved == 2 * (linear - kept)
    assert held.get_input_embeddings().weight.dtype == torch.float32
    assert held.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert held.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    assert (held.get_output_embeddings().weight.dtype == torch.float32) == tie


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, file name) of this process's mapping holding `address`."""
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi:
            return parts[1], parts[-1].rsplit("/", 1)[-1]
    return "", ""


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_teacher_s_table_left_in_its_file_gives_the_same_logits(tmp_path, kind):
    """table_in_file: the tied table read from the checkpoint's bytes, its head a bf16 copy; under bf16 autocast the
    logits are bit for bit those before. A table something wrote to (no longer the file's bytes) stays."""
    from tiny import save_tiny

    from geminicompress.distill.frozen_teacher import table_in_file
    from geminicompress.models.loading import load_model

    folder = save_tiny(tmp_path / "t", kind=kind, vocab_size=4096, tie_word_embeddings=True)
    teacher = load_model(str(folder)).model.eval().requires_grad_(False)
    ids = torch.randint(0, 4096, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = teacher(ids).logits
    vocab, width = teacher.get_input_embeddings().weight.shape
    assert table_in_file(teacher, torch.bfloat16) == vocab * width * (4 - 2)
    assert teacher.get_output_embeddings().weight.dtype == torch.bfloat16
    assert _mapping_of(teacher.get_input_embeddings().weight.data_ptr()) == ("r--s", "model.safetensors")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = teacher(ids).logits
    assert torch.equal(before, after)
    written = load_model(str(folder)).model
    with torch.no_grad():
        written.get_input_embeddings().weight[0] += 1.0
    assert table_in_file(written, torch.bfloat16) == 0
