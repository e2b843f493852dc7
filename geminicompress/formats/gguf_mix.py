"""llama-quantize's mixes as data: which GGUF type each tensor of a `--gguf-type` file gets.

Read from llama.cpp's src/llama-quant.cpp (`llama_tensor_get_type_impl`, `tensor_type_fallback`, llama-cpp-python
0.3.36), for the dense architectures written here (llama, qwen2, gemma3: no experts, not Falcon, not a 70B):

1. every quantized weight starts at the mix's default type (`MIXES`);
2. the output head, and the token embedding when it is tied to it, get Q8_0 when its row is not a multiple of the
   default type's block, else Q6_K (Q8_0 stays Q8_0); an untied token embedding keeps the default;
3. `RULES`: the first rule of the tensor's role that names the mix and whose condition holds replaces the type
   (conditions on the layer index i of n, or on the model: `CONDITIONS`);
4. a row that the chosen type's block does not divide falls back (`FALLBACK`), to F16 if that fails too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from geminicompress.core.errors import InputError

# mix -> the type of every tensor no rule changes
MIXES: dict[str, str] = {
    "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* of each mix (general.file_type; llama_model_quantize's ftype)
FTYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
                          "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17,
                          "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
BLOCK: dict[str, int] = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32, "F16": 1,
                         "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256}
FALLBACK: dict[str, str] = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
                            "IQ4_XS": "IQ4_NL"}


@dataclass(frozen=True)
class Model:
    """What the conditions read: the layer count, heads per KV head, whether an importance matrix is used."""

    n_layer: int
    gqa: int
    imatrix: bool


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


CONDITIONS: dict[str, Callable[[int, int, Model], bool]] = {
    "always": lambda i, n, m: True,
    "more_bits": lambda i, n, m: _more_bits(i, n),
    "first_eighth": lambda i, n, m: i < n // 8,
    "first_sixteenth": lambda i, n, m: i < n // 16,
    "first_two": lambda i, n, m: i < 2,
    "first_four": lambda i, n, m: i < 4,
    "gqa4": lambda i, n, m: m.gqa >= 4,
    "first_eighth_no_imatrix": lambda i, n, m: i < n // 8 and not m.imatrix,
    "first_eighth_imatrix": lambda i, n, m: i < n // 8 and m.imatrix,
}

# (role, mixes, condition, type): the first rule of a role naming the mix whose condition holds
RULES: list[tuple[str, tuple[str, ...], str, str]] = [
    ("attn_v", ("Q2_K",), "gqa4", "Q4_K"),
    ("attn_v", ("Q2_K",), "always", "Q3_K"),
    ("attn_v", ("Q3_K_M",), "first_two", "Q5_K"),
    ("attn_v", ("Q3_K_M",), "always", "Q4_K"),
    ("attn_v", ("Q3_K_L",), "always", "Q5_K"),
    ("attn_v", ("IQ4_NL", "IQ4_XS"), "gqa4", "Q5_K"),
    ("attn_v", ("Q4_K_M", "Q5_K_M"), "more_bits", "Q6_K"),
    ("attn_v", ("Q4_K_S",), "first_four", "Q5_K"),
    ("ffn_down", ("Q2_K",), "always", "Q3_K"),
    ("ffn_down", ("Q3_K_M",), "first_sixteenth", "Q5_K"),
    ("ffn_down", ("Q3_K_M",), "always", "Q4_K"),
    ("ffn_down", ("Q3_K_L",), "always", "Q5_K"),
    ("ffn_down", ("Q4_K_M", "Q5_K_M"), "more_bits", "Q6_K"),
    ("ffn_down", ("IQ4_NL", "IQ4_XS"), "first_eighth_no_imatrix", "Q5_K"),
    ("ffn_down", ("Q4_K_S",), "first_eighth", "Q5_K"),
    ("ffn_down", ("Q4_0",), "first_eighth_imatrix", "Q4_1"),
    ("ffn_down", ("Q5_0",), "first_eighth_imatrix", "Q5_1"),
    ("attn_output", ("Q2_K",), "always", "Q3_K"),
    ("attn_output", ("Q3_K_M",), "always", "Q4_K"),
    ("attn_output", ("Q3_K_L",), "always", "Q5_K"),
]


def role(name: str) -> str:
    """A GGUF tensor name's role in the rules: "output", "token_embd", "attn_v", "ffn_down", ... or "other"."""
    if name in ("output.weight", "token_embd.weight"):
        return name.split(".")[0]
    for r in ("attn_v", "ffn_down", "attn_output", "attn_q", "attn_k", "ffn_gate", "ffn_up"):
        if f".{r}." in name:
            return r
    return "other"


def fallback(qtype: str, cols: int) -> str:
    """The type a row of `cols` takes when `qtype`'s block does not divide it (tensor_type_fallback)."""
    if cols % BLOCK[qtype] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, qtype)
    return qtype if cols % BLOCK[qtype] == 0 else "F16"


def tensor_type(name: str, cols: int, layer: int | None, mix: str, model: Model, tied: bool) -> str:
    """The type llama-quantize gives the quantizable tensor `name` (GGUF name; rows of `cols`) in `mix`."""
    default = MIXES[mix]
    kind = role(name)
    qtype = default
    if kind == "output" or (kind == "token_embd" and tied):
        qtype = "Q8_0" if cols % BLOCK[default] else ("Q8_0" if default == "Q8_0" else "Q6_K")
    elif layer is not None:
        for rule_role, mixes, cond, rule_type in RULES:
            if rule_role == kind and mix in mixes and CONDITIONS[cond](layer, model.n_layer, model):
                qtype = rule_type
                break
    return fallback(qtype, cols)


def check_mix(mix: str) -> str:
    """The mix's canonical name; InputError (one line) for one llama.cpp has not."""
    key = mix.upper()
    if key not in MIXES:
        raise InputError(f"--gguf-type {mix}: not a type written here (one of {', '.join(MIXES)})")
    return key


def plan(tensors: dict[str, tuple[int, int | None]], mix: str, model: Model, tied: bool) -> dict[str, str]:
    """{GGUF tensor name: type} for `tensors` {name: (cols, layer index or None)}, llama-quantize's choice."""
    mix = check_mix(mix)
    return {name: tensor_type(name, cols, layer, mix, model, tied) for name, (cols, layer) in tensors.items()}
