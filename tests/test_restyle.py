"""Restyled training text (data/restyle.py): the spellings each style writes, stretches that give the text back,
share 0 as the identity, never WikiText-2's '@', and the distill stage's windows: held-out ones untouched."""

import random

import pytest
import torch

from geminicompress.data import pack_windows, tokenize
from geminicompress.data.restyle import MARKERS, Style, draw, restyle, restyle_line, stretches
from geminicompress.distill.stage import restyled_windows
from geminicompress.host.progress import NullProgress

TEXT = "\n".join(
    f"Paragraph {i}: a well-known author's 1,000.5 pages (and more). It isn't short; the end." for i in range(400)) + "\n"


@pytest.mark.parametrize("style,expected", [
    (Style(False, "", False, False, False), "A well-known author's 1,000.5 pages (and more). The end."),
    (Style(False, "#", False, False, False), "A well #-# known author's 1 #,# 000 #.# 5 pages (and more). The end."),
    (Style(True, "", False, False, False), "A well-known author's 1,000.5 pages ( and more ) . The end ."),
    (Style(False, "", True, True, False), "a well-known author 's 1,000.5 pages (and more). the end."),
    (Style(True, "~", True, False, False),
     "A well ~-~ known author 's 1 ~,~ 000 ~.~ 5 pages ( and more ) . The end ."),
])
def test_each_feature_spells_the_line_its_way(style, expected):
    assert restyle_line("A well-known author's 1,000.5 pages (and more). The end.", style) == expected


def test_abbreviations_keep_their_full_stops():
    assert restyle_line("The U.S. team won, said Dr. Smith.", Style(True, "", False, False, False)) == \
        "The U.S. team won , said Dr. Smith ."


@pytest.mark.parametrize("size", [1, 50, 1000, 10**6])
def test_stretches_cut_at_line_ends_and_give_the_text_back(size):
    parts = stretches(TEXT, size)
    assert "".join(parts) == TEXT
    assert all(p.endswith("\n") for p in parts)
    assert all(len(p) >= size for p in parts[:-1])
    if size >= len(TEXT):
        assert len(parts) == 1


def test_share_zero_is_the_text_and_share_one_restyles_every_stretch():
    assert restyle(TEXT, 0.0, seed=0, size=1000) == (TEXT, 0, len(stretches(TEXT, 1000)))
    styled, count, total = restyle(TEXT, 1.0, seed=0, size=1000)
    assert count == total == len(stretches(TEXT, 1000)) > 20
    assert styled != TEXT and "@" not in styled
    assert restyle(TEXT, 1.0, seed=0, size=1000) == (styled, count, total)  # seeded
    assert restyle(TEXT, 1.0, seed=1, size=1000)[0] != styled


def test_about_the_share_is_restyled_and_the_rest_is_kept_verbatim():
    styled, count, total = restyle(TEXT, 0.5, seed=3, size=500)
    assert total == len(stretches(TEXT, 500))
    assert 0.25 * total < count < 0.75 * total
    kept = [p for p in stretches(TEXT, 500) if p in styled]
    assert len(kept) >= total - count  # every stretch not drawn is there as it was


def test_markers_never_draw_wikitexts_own():
    rng = random.Random(0)
    drawn = {draw(rng).marker for _ in range(2000)}
    assert "@" not in MARKERS and drawn == {"", *MARKERS}


def test_restyled_windows_keep_the_window_length_and_follow_the_restyled_text(tok):
    ids = tokenize(tok, TEXT)
    windows = pack_windows(ids, 64)
    train = windows[:-2]
    out = restyled_windows(tok, train, 1.0, seed=0, progress=NullProgress())
    assert out.shape[1] == 64 and out.dtype == torch.long
    text = tok.decode(train.reshape(-1).tolist(), clean_up_tokenization_spaces=False)
    assert text == TEXT[: len(text)]  # the tokenizer gives the training text back: only it is restyled
    styled, _, _ = restyle(text, 1.0, 0)
    assert torch.equal(out.reshape(-1), tokenize(tok, styled)[: out.numel()])
    assert not torch.equal(out[: len(train)], train[: len(out)])
