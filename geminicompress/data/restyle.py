"""Training text restyled in random spellings, each kept through a stretch of text: a student that must read
the spelling from context, as its teacher does.

A student cut from its teacher loses part of what the teacher does in context: on WikiText-2, whose text is
spelled its own way (` , ` apart, ` @-@ ` inside a word), a third of a 24-of-30-layer cut's damage sat on those
spellings, and KD on plain Wikipedia text did not bring it back (docs/distill.md). Restyling the training text
asks for that skill on any text: the text is cut into stretches of about `STRETCH_CHARS` characters at line
ends, and a share of them is rewritten in a random style drawn for that stretch:
- punctuation apart (`end , then .`), as tokenized corpora write it;
- a marker symbol around a hyphen inside a word and a separator inside a number (` #-# `, ` ~,~ `);
- clitics apart (`it 's`); lower case; a blank line between paragraphs.
The markers never include `@`, WikiText-2's own: the evaluated spelling is never the trained one. The
teacher's soft targets on a restyled stretch are what the student learns from; the other stretches stay as
they are.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MARKERS = "#~^|*+"  # none of them punctuation that a style sets apart
STRETCH_CHARS = 16_000  # ~4k tokens: a 512-token window mostly inside one style

_NUMBER_SEP = re.compile(r"(?<=\d)([,.])(?=\d)")
_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")
_CLITIC = re.compile(r"(?<=\w)'(s|t|re|ve|m|ll|d)\b")
_PUNCT = re.compile(r"""([,;:!?()\[\]"%$/–—…])""")
_ABBREVIATION = re.compile(r"(?:[A-Za-z]\.)+|(?:St|Dr|Mr|Mrs|Ms|Jr|Sr|No|vs|c|ca)\.")


@dataclass(frozen=True)
class Style:
    apart: bool  # punctuation and full stops apart
    marker: str  # "" or the symbol around in-word hyphens and in-number separators
    clitics: bool
    lower: bool
    blank: bool  # a blank line between paragraphs


def draw(rng: random.Random) -> Style:
    """A random style: each feature by its own coin, a marker in 7 of 10."""
    return Style(rng.random() < 0.5, rng.choice(MARKERS) if rng.random() < 0.7 else "", rng.random() < 0.5,
                 rng.random() < 0.25, rng.random() < 0.5)


def _full_stop(token: str) -> str:
    if len(token) > 1 and token.endswith(".") and not _ABBREVIATION.fullmatch(token):
        return token[:-1] + " ."
    return token


def restyle_line(line: str, style: Style) -> str:
    """One paragraph in `style`, e.g. 'a well-known 1,000' -> 'a well #-# known 1 #,# 000' with marker '#'."""
    # separators inside numbers and marked hyphens wait as placeholders, so that punctuation apart leaves them be
    text = _NUMBER_SEP.sub(lambda g: "\0C" if g.group(1) == "," else "\0D", line.strip())
    if style.marker:
        text = _HYPHEN.sub(" \0H ", text)
    if style.clitics:
        text = _CLITIC.sub(r" '\1", text)
    if style.apart:
        text = _PUNCT.sub(r" \1 ", text)
        text = " ".join(_full_stop(token) for token in text.split())
    m = style.marker
    text = text.replace("\0C", f" {m},{m} " if m else ",").replace("\0D", f" {m}.{m} " if m else ".")
    text = text.replace("\0H", f"{m}-{m}")
    return text.lower() if style.lower else text


def stretches(text: str, size: int = STRETCH_CHARS) -> list[str]:
    """`text` cut at line ends into consecutive pieces of at least `size` characters (the last may be shorter);
    joined again they give `text` back."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def restyle(text: str, share: float, seed: int, size: int = STRETCH_CHARS) -> tuple[str, int, int]:
    """(the text with about `share` of its stretches restyled, how many were, how many stretches in all).
    share 0 gives `text` back."""
    rng = random.Random(seed)
    parts, styled = [], 0
    pieces = stretches(text, size)
    for piece in pieces:
        if rng.random() >= share:
            parts.append(piece)
            continue
        style = draw(rng)
        lines = [restyle_line(line, style) for line in piece.split("\n") if line.strip()]
        parts.append(("\n\n" if style.blank else "\n").join(lines) + "\n")
        styled += 1
    return "".join(parts), styled, len(pieces)
