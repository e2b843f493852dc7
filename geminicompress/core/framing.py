"""How a window starts: the token ids a model's tokenizer puts before a text (its BOS, where it adds one).

Ground floor: a tokenizer in, ids out; `data/windows.py` frames every window with it and `formats/gguf_vocab.py`
writes llama.cpp's `add_bos_token` from it, so every engine starts a text the same way.
"""

from __future__ import annotations

from typing import Literal, Sequence

from geminicompress.core.errors import InputError

Frame = Literal["tokenizer", "text"]
FRAMES = ("tokenizer", "text")
_PROBE = "Hello world"  # any text: what the tokenizer adds around it is what it adds around every text


def text_prefix(tokenizer, frame: Frame = "tokenizer", vocab: int | None = None) -> tuple[int, ...]:
    """The token ids the tokenizer puts before a text (`()` for frame "text", or a tokenizer that adds none).
    An InputError when the tokenizer names a BOS token its vocabulary lacks (transformers then appends it as a
    new token, past the `vocab` rows of the model's embedding), or adds more than one token."""
    if frame not in FRAMES:
        raise InputError(f"frame '{frame}' is not one of {', '.join(FRAMES)}")
    if frame == "text":
        return ()
    _check_bos(tokenizer)
    framed = list(tokenizer(_PROBE, add_special_tokens=True, return_attention_mask=False)["input_ids"])
    plain = list(tokenizer(_PROBE, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), None)
    if at is None:
        raise InputError("the tokenizer splits a text differently with its special tokens than without them; "
                         "windows cannot be framed as it frames a text (use frame: text, --frame text)")
    if at > 1:
        raise InputError(f"the tokenizer puts {at} tokens ({framed[:at]}) before a text; only a one-token prefix "
                         "(a BOS) is framed, so that no prefix token is scored (use frame: text, --frame text)")
    prefix = tuple(framed[:at])
    if vocab is not None and any(i >= vocab for i in prefix):
        names = tokenizer.convert_ids_to_tokens(list(prefix))
        raise InputError(f"the tokenizer starts every text with {names[0]!r} (id {prefix[0]}), a token the model's "
                         f"vocabulary of {vocab} does not have: its tokenizer_config.json names a BOS token the "
                         "vocabulary lacks; fix bos_token there, or use --frame text (frame: text)")
    return prefix


def _check_bos(tokenizer) -> None:
    bos = getattr(tokenizer, "bos_token", None)
    if bos is None:
        return
    known = tokenizer.convert_tokens_to_ids(bos)
    unk = getattr(tokenizer, "unk_token", None)
    if known is None or (unk is not None and bos != unk and known == tokenizer.convert_tokens_to_ids(unk)):
        raise InputError(f"the tokenizer's config names '{bos}' as its BOS token, but its vocabulary has no such "
                         "token: fix tokenizer_config.json (bos_token) or the vocabulary")


def vocab_of(model) -> int | None:
    """The rows of a model's embedding as its config states them (None when the config names none)."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


def prefix_note(tokenizer, prefix: Sequence[int]) -> dict:
    """What report.json says of the framing: the prefix ids and their tokens."""
    return {"prefix_ids": list(prefix), "prefix_tokens": tokenizer.convert_ids_to_tokens(list(prefix))}
