"""Text sources and windows: every file type, packing, seeded sampling, clear errors."""

import json

import pytest
import torch

from geminicompress.data import pack_windows, read_text, sample_windows, tokenize
from geminicompress.data.sources import check_data_spec
from geminicompress.core.errors import InputError


def test_file_types_give_the_same_text(tmp_path):
    docs = ["first document.", "second one, with a comma", "third"]
    (tmp_path / "a.txt").write_text("\n\n".join(docs))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)))
    (tmp_path / "a.json").write_text(json.dumps([{"body": d} for d in docs]))
    (tmp_path / "a.csv").write_text("id,text\n" + "\n".join(f'{i},"{d}"' for i, d in enumerate(docs)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    expected = "\n\n".join(docs)
    assert read_text(str(tmp_path / "a.txt")) == expected
    assert read_text(str(tmp_path / "a.jsonl")) == expected
    assert read_text(str(tmp_path / "a.json"), text_column="body") == expected
    assert read_text(str(tmp_path / "a.csv")) == expected
    assert read_text(str(tmp_path / "a.parquet")) == expected
    with pytest.raises(InputError, match="no column 'text'.*--text-column"):
        read_text(str(tmp_path / "a.json"))


def test_builtin_text_is_offline_and_long():
    text = read_text("builtin:pydoc")
    assert len(text) > 300_000
    with pytest.raises(InputError, match="unknown built-in"):
        check_data_spec("builtin:nope")


def test_pack_windows_non_overlapping():
    ids = torch.arange(10)
    w = pack_windows(ids, 3)
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert pack_windows(ids, 3, max_windows=2).shape == (2, 3)
    with pytest.raises(InputError, match="fewer than one window"):
        pack_windows(ids, 11)


def test_sample_windows_seeded_and_valid():
    ids = torch.arange(1000)
    a = sample_windows(ids, 8, 16, seed=3)
    b = sample_windows(ids, 8, 16, seed=3)
    c = sample_windows(ids, 8, 16, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (8, 16)
    assert torch.all(a[:, 1:] - a[:, :-1] == 1)  # contiguous slices of the stream
    state = torch.get_rng_state()
    sample_windows(ids, 8, 16, seed=3)
    assert torch.equal(state, torch.get_rng_state())  # global RNG untouched


def test_tokenize_prefix_matches_full(tok, text_file):
    text = text_file.read_text()
    full = tokenize(tok, text)
    assert torch.equal(tokenize(tok, text, max_tokens=500), full[:500])
