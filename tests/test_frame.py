"""Windows framed as the tokenizer frames a text (data/windows.py): its BOS first where it adds one, never scored,
included in the calibration statistics; nothing changes for a tokenizer that adds none."""

import json

import pytest
import torch
from tokenizers import processors
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.data import calibration_windows, pack_windows, sample_windows, text_prefix, tokenize
from geminicompress.core.errors import InputError
from tiny import tiny_model, tiny_tokenizer

runner = CliRunner()
BOS = "<|endoftext|>"


def bos_tokenizer():
    """The tiny tokenizer, made to put its BOS before every text (as Gemma's, Llama 3's and Mistral's do)."""
    tok = tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.convert_tokens_to_ids(BOS))])
    return tok


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bos") / "tiny-bos"
    tiny_model().save_pretrained(path)
    bos_tokenizer().save_pretrained(path)
    return path


def test_prefix_is_what_the_tokenizer_puts_before_a_text():
    tok, plain = bos_tokenizer(), tiny_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS)
    assert tok("some text")["input_ids"][0] == bos
    assert text_prefix(tok) == (bos,)
    assert text_prefix(tok, "text") == ()
    assert text_prefix(plain) == ()  # a tokenizer that adds nothing: windows as before
    with pytest.raises(InputError, match="frame 'bos' is not one of tokenizer, text"):
        text_prefix(tok, "bos")


def test_framed_windows_hold_the_prefix_then_consecutive_text():
    ids = torch.arange(100, 200)
    w = pack_windows(ids, 8, prefix=(7,))
    assert w.shape == (100 // 7, 8)
    assert torch.all(w[:, 0] == 7)
    assert torch.equal(w[:, 1:].reshape(-1), ids[: w.shape[0] * 7])  # 7 text tokens a window, none skipped
    s = sample_windows(ids, 5, 8, seed=1, prefix=(7,))
    assert torch.all(s[:, 0] == 7) and torch.all(s[:, 2:] - s[:, 1:-1] == 1)
    # no prefix: exactly the windows of before (the demo's and the tiny model's outputs keep their bytes)
    assert torch.equal(pack_windows(ids, 8), ids[:96].view(12, 8))
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, ids.numel() - 8, (5,), generator=gen).tolist()
    assert torch.equal(sample_windows(ids, 5, 8, seed=1), torch.stack([ids[i:i + 8] for i in starts]))
    with pytest.raises(InputError, match="holds no text after"):
        pack_windows(ids, 1, prefix=(7,))


def test_calibration_windows_start_with_bos(text_file):
    tok = bos_tokenizer()
    w = calibration_windows(tok, str(text_file), 4, 32, seed=0)
    assert torch.all(w[:, 0] == tok.convert_tokens_to_ids(BOS))
    text = calibration_windows(tok, str(text_file), 4, 32, seed=0, frame="text")
    assert torch.equal(text, calibration_windows(tiny_tokenizer(), str(text_file), 4, 32, seed=0))


def test_eval_scores_the_text_after_bos_never_bos(bos_dir, text_file, tmp_path):
    """Perplexity of BOS-led windows equals the one computed by hand over their text tokens only."""
    res = runner.invoke(app, ["eval", str(bos_dir), "-o", str(tmp_path / "r"), "--data", str(text_file),
                              "--seq-len", "64", "--max-tokens", "630", "--no-latency", "--threads", "1"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["window_prefix"]["prefix_tokens"] == [BOS]
    quality = report["models"][0]["quality"]
    tok, model = bos_tokenizer(), tiny_model()
    windows = pack_windows(tokenize(tok, text_file.read_text(), 630), 64, prefix=text_prefix(tok))
    assert quality["windows"] == windows.shape[0] == 630 // 63 and quality["tokens"] == windows.shape[0] * 63
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, windows[:, 1:, None]).mean()  # targets: the text tokens; BOS is never one
    assert quality["perplexity"] == pytest.approx(float(torch.exp(nll)), rel=1e-4)
    res = runner.invoke(app, ["eval", str(bos_dir), "-o", str(tmp_path / "t"), "--data", str(text_file),
                              "--seq-len", "64", "--max-tokens", "630", "--no-latency", "--threads", "1",
                              "--frame", "text"])
    text = json.loads((tmp_path / "t" / "report.json").read_text())
    assert text["window_prefix"]["prefix_ids"] == [] and text["models"][0]["quality"]["perplexity"] != quality["perplexity"]


def test_calibration_statistics_include_the_bos_position(bos_dir, text_file, tmp_path, monkeypatch):
    """GPTQ's Hessians see position 0 of every window: the BOS, so the first layer's input there is the
    same in every window."""
    from geminicompress.compress.hessian import HessianAccumulator

    seen = []
    add = HessianAccumulator.add_batch

    def record(self, x, *a, **k):
        if len(seen) < 1:
            seen.append(x.detach().clone())
        return add(self, x, *a, **k)

    monkeypatch.setattr(HessianAccumulator, "add_batch", record)
    res = runner.invoke(app, ["quantize", str(bos_dir), "-o", str(tmp_path / "q"), "--method", "gptq",
                              "--data", str(text_file), "--samples", "4", "--calib-seq-len", "32",
                              "--no-verify", "--threads", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    x = seen[0].reshape(-1, 32, seen[0].shape[-1])  # (windows, T, in) of the first linear's inputs
    assert x.shape[0] >= 2
    assert torch.allclose(x[:, 0], x[:1, 0].expand_as(x[:, 0]))  # BOS at position 0 of every window
    assert not torch.allclose(x[:, 1], x[:1, 1].expand_as(x[:, 1]))  # then different text
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert report["frame"] == "tokenizer" and report["window_prefix"]["prefix_tokens"] == [BOS]


def test_a_bos_the_vocabulary_lacks_is_one_line(bos_dir, text_file, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bos_dir, broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<nope>"  # transformers appends it as a new token, past the embedding's rows
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    tj = json.loads((broken / "tokenizer.json").read_text())
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<nope>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                            "special_tokens": {"<nope>": {"id": "<nope>", "ids": [384], "tokens": ["<nope>"]}}}
    (broken / "tokenizer.json").write_text(json.dumps(tj))
    for args in (["eval", str(broken), "-o", str(tmp_path / "e"), "--seq-len", "64", "--max-tokens", "256",
                  "--no-latency"],
                 ["quantize", str(broken), "-o", str(tmp_path / "q"), "--method", "gptq", "--samples", "2",
                  "--calib-seq-len", "32", "--data", str(text_file)]):
        res = runner.invoke(app, [*args, "--threads", "1"])
        assert res.exit_code == 2, res.output
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert "'<nope>'" in res.output and "vocabulary" in res.output and "--frame text" in res.output
        assert lines[-1].startswith("error:")
        assert not (tmp_path / "q").exists() and not (tmp_path / "e").exists()


def test_gguf_says_whether_llama_cpp_starts_a_text_with_bos(bos_dir, tiny_dir, tmp_path):
    """llama.cpp's own tools frame text as our eval does: add_bos_token (and the BOS id) as the tokenizer does."""
    from gguf import GGUFReader

    from geminicompress.formats.gguf_export import export

    for folder, expected in ((bos_dir, True), (tiny_dir, False)):
        path = tmp_path / f"{folder.name}.gguf"
        export(folder, dest=path)
        fields = GGUFReader(path).fields
        assert bool(fields["tokenizer.ggml.add_bos_token"].contents()) is expected
        if expected:
            assert fields["tokenizer.ggml.bos_token_id"].contents() == bos_tokenizer().convert_tokens_to_ids(BOS)
