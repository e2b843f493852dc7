"""Tokenizer metadata of a GGUF file (`tokenizer.ggml.*`), the way llama.cpp's converter writes it.

- The model came from a GGUF file (the demo did): its `tokenizer.*` keys are copied as they are.
- Otherwise it is built from the transformers tokenizer saved in OUT:
  - SentencePiece-style BPE (tokenizer.json with `byte_fallback`: Llama 1/2, Mistral): model "llama", pre
    "default", tokens/scores/types from `gguf.LlamaHfVocab` (the converter's `_set_vocab_llama_hf`);
  - byte-level BPE (GPT-2 style: Llama 3, Qwen2, SmolLM): model "gpt2", the tokens and their types as
    `get_vocab_base` makes them, and `pre` from the sha256 of the token ids of a fixed text (gguf_pre.py);
  - the special token ids, add_eos, merges and the chat template from `gguf.SpecialVocab`; add_bos (and the BOS
    id) as the transformers tokenizer frames a text (`special_vocab`), so llama.cpp's tools frame text as we do.
A tokenizer of neither kind, or a BPE pre-tokenizer llama.cpp does not know, is refused in one line.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFReader, GGUFValueType, TokenType

from geminicompress.core.errors import InputError
from geminicompress.formats.gguf_pre import CHKTXT, PRE


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every `tokenizer.*` key of the GGUF file `source`; returns the number of tokens."""
    fields = GGUFReader(source).fields
    for key, field in fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    if "tokenizer.ggml.tokens" not in fields:
        raise InputError(f"{source} has no tokenizer.ggml.tokens to copy")
    return len(fields["tokenizer.ggml.tokens"].data)


def build_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> str:
    """Write the tokenizer of the transformers directory `folder`; returns the tokenizer model it wrote."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{folder} has no tokenizer.json to build GGUF tokenizer metadata from")
    model = json.loads(path.read_text()).get("model", {})
    if model.get("type") != "BPE":
        raise InputError(f"{path}: a {model.get('type')} tokenizer is not written to GGUF here (BPE only)")
    if model.get("byte_fallback"):
        _sentencepiece(writer, folder, vocab_size)
        return "llama"
    _byte_bpe(writer, folder, vocab_size)
    return "gpt2"


def _sentencepiece(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(toktype)
    for i in range(len(tokens), vocab_size):  # the embedding may have more rows than the tokenizer has tokens
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special_vocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)


def _byte_bpe(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    pre = tokenizer_pre(tok)
    tokens, types = vocab_base(tok, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab(folder, load_merges=True).add_to_gguf(writer)


def special_vocab(folder: Path, **kwargs: Any) -> gguf.SpecialVocab:
    """The converter's special tokens, merges and chat template, with `add_bos_token` set as the transformers
    tokenizer frames a text (data/windows.py): llama.cpp's tools then start every text as our eval does. Left to
    the converter, a tokenizer.json without the key gets llama.cpp's default (BOS for SentencePiece models)."""
    from transformers import AutoTokenizer

    from geminicompress.core.framing import text_prefix

    vocab = gguf.SpecialVocab(folder, **kwargs)
    prefix = text_prefix(AutoTokenizer.from_pretrained(str(folder)))
    vocab.add_special_token["bos"] = bool(prefix)
    if prefix:
        vocab.special_token_ids["bos"] = prefix[0]
    return vocab


def tokenizer_pre(tok: Any) -> str:
    """llama.cpp's name for the pre-tokenizer of transformers tokenizer `tok`: the converter's table (sha256 of
    the ids of a fixed text), else, for a plain byte-level pre-tokenizer with GPT-2's regex, "gpt-2";
    "default" for a SentencePiece-style (byte-fallback) BPE. InputError when llama.cpp would split otherwise."""
    spec = json.loads(tok.backend_tokenizer.to_str()) if hasattr(tok, "backend_tokenizer") else {}
    if spec.get("model", {}).get("byte_fallback"):
        return "default"
    digest = sha256(str(tok.encode(CHKTXT)).encode()).hexdigest()
    if digest in PRE:
        return PRE[digest]
    name = _pre_by_structure(spec.get("pre_tokenizer") or {})
    if name is not None:
        return name
    raise InputError(f"llama.cpp does not know this tokenizer's pre-tokenizer (chkhsh {digest[:12]}…), so a GGUF "
                     "would split text differently; quantize the model's own .gguf file instead")


# The split regexes of llama.cpp's byte-level pre-tokenizers (llama-vocab.cpp) that tokenizer.json spells as
# Split(regex, Isolated) then ByteLevel without its own regex.
_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
REGEX_PRE = {_SPLIT % "": "qwen2", _SPLIT % "{1,3}": "llama-bpe"}


def _pre_by_structure(pre: dict[str, Any]) -> str | None:
    """The pre-tokenizer name from tokenizer.json's `pre_tokenizer` when its hash is not in the table (a model
    trained with a known pre-tokenizer on its own vocabulary): GPT-2's byte-level regex, Qwen2's or Llama 3's."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = pre.get("pretokenizers") or []
    if (pre.get("type") == "Sequence" and len(parts) == 2 and parts[0].get("type") == "Split"
            and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)):
        return REGEX_PRE.get((parts[0].get("pattern") or {}).get("Regex"))
    return None


def vocab_base(tok: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token text and type, as llama.cpp's converter lists them (`get_vocab_base`): missing ids
    are unused pads, added tokens are control (special) or user-defined, pre-normalised."""
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))
