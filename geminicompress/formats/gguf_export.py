"""OUT as one GGUF file for llama.cpp (and Ollama, LM Studio): `--format gguf` writes OUT/model.gguf beside the
checkpoint, from the checkpoint as written, one module at a time.

The checkpoint's quantized linears are read by their format's reader (formats/) and written as the GGUF block
type that holds their codes exactly (formats/gguf.py); float linears as F16 (or F32), norms and biases as F32,
the embeddings as Q8_0 (or F16/F32: `embeddings`), an untied float output head likewise, a tied one not at
all (llama.cpp reads token_embd.weight for it). Rows of q_proj/k_proj (codes, scales and biases alike) are
reordered as llama.cpp's converter does for the llama architecture (not for qwen2 and gemma3). Metadata: the
llama.cpp hyperparameters of the architecture (rope.freq_base and the RMS epsilon included: llama.cpp silently
takes 10000 and 1e-5 when they are missing), and the tokenizer (gguf_vocab.py). Gemma 3 (convert_hf_to_gguf's
Gemma3Model): norms written as 1 + w, the sliding window, the global layers' rope base; what llama.cpp's gemma3
graph hard-codes instead of reading (`_gemma3_refusal`) is checked before any work.

Memory: one module's tensors at a time; the written blocks go to a spooled temporary file (gguf's
`use_temp_file`), which spills to disk past 256 MB.

As a quantized format: `writer(...)` writes the checkpoint in GPTQ format (which holds every grid GGUF
takes) and marks it for the export that follows verification (pipeline.py).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats import gguf as blocks
from geminicompress.formats.checkpoint import weight_files
from geminicompress.core.gguf_config import AUTO, AUTO_BASE
from geminicompress.formats import gguf_mix
from geminicompress.formats.gguf_blocks import bits_per_weight as blocks_bits
from geminicompress.formats.gguf_blocks import read_blocks, rtn_bytes
from geminicompress.formats.gguf_vocab import build_tokenizer, copy_tokenizer

KEY = "gguf"
GROUPS = None  # its rules are blocks of 32 inputs (check_shape), not whole groups
FILE = "model.gguf"


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture
    arch: gguf.MODEL_ARCH  # the tensor-name table
    permute_qk: bool  # the converter reorders q/k rows (rotate-half -> interleaved rope)
    norm_shift: float = 0.0  # added to every norm weight: Gemma's RMSNorm scales by (1 + w), llama.cpp's by w


# model_type -> how llama.cpp names it (its converter maps Mistral to the llama architecture)
ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", gguf.MODEL_ARCH.LLAMA, True),
    "mistral": GGUFArch("llama", gguf.MODEL_ARCH.LLAMA, True),
    "qwen2": GGUFArch("qwen2", gguf.MODEL_ARCH.QWEN2, False),
    "gemma3_text": GGUFArch("gemma3", gguf.MODEL_ARCH.GEMMA3, False, 1.0),  # neox rope: no reordering
}
# What llama.cpp's gemma3 graph hard-codes instead of reading it from the file (llama_load_hparams_gemma3):
GEMMA3_SWA_PATTERN = 6  # every 6th layer global, the others sliding-window
GEMMA3_SWA_ROPE_BASE = 10000.0  # the sliding layers' rope base, unscaled


@dataclass(frozen=True)
class GGUFOptions:
    asym: str = "q5_0"  # asymmetric <= 4-bit codes: q5_0 (exact) or q4_1 (its m rounded to fp16)
    embeddings: str = "q8_0"  # token embeddings and an untied float head: q8_0, f16 or f32
    floats: str = "f16"  # float linears (dense or pruned): f16 or f32
    mix: str | None = None  # --gguf-type: llama-quantize's mix (formats/gguf_mix.py) or AUTO; the blocks come from OUT


def gguf_arch(config: dict[str, Any]) -> GGUFArch:
    """The GGUF architecture of a config.json; InputError (one line) for one we cannot name, or a rope
    scaling we do not write."""
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise InputError(f"--format gguf writes the architectures {', '.join(ARCHS)}; this model is "
                         f"'{model_type}' (use another --format)")
    if model_type == "gemma3_text" and (why := _gemma3_refusal(config)):
        raise InputError(f"--format gguf: llama.cpp's gemma3 {why}; this model cannot be written for it")
    scaling = _rope(config).get("rope_type", "default")
    if scaling not in ("default", "linear", "llama3") or (scaling == "llama3" and not ARCHS[model_type].permute_qk):
        raise InputError(f"--format gguf: rope scaling '{scaling}' is not written to GGUF here "
                         "(default, linear, and llama3 for the llama architecture are)")
    return ARCHS[model_type]


def _gemma3_refusal(config: dict[str, Any]) -> str | None:
    """Why llama.cpp's gemma3 graph would compute another model than this config (it hard-codes the layer
    pattern, the sliding layers' rope and the attention scale), or None."""
    n, pattern = config["num_hidden_layers"], GEMMA3_SWA_PATTERN
    layers = config.get("layer_types") or [
        "full_attention" if (i + 1) % config.get("sliding_window_pattern", pattern) == 0 else "sliding_attention"
        for i in range(n)]
    if layers != ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]:
        return f"makes every {pattern}th layer global and the others sliding-window"
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {
        "rope_theta": config.get("rope_local_base_freq", GEMMA3_SWA_ROPE_BASE)}
    if local.get("rope_type", "default") != "default" or float(local["rope_theta"]) != GEMMA3_SWA_ROPE_BASE:
        return f"gives the sliding layers rope base {GEMMA3_SWA_ROPE_BASE:g}, unscaled"
    heads, head_dim = config["num_attention_heads"], config.get("head_dim", 256)
    scalar = config["hidden_size"] // heads if n == 62 else head_dim  # 27B: hidden / heads
    if config.get("query_pre_attn_scalar", scalar) != scalar:
        return f"scales attention by 1/sqrt({scalar}) (query_pre_attn_scalar is {config['query_pre_attn_scalar']})"
    if config.get("attn_logit_softcapping") or config.get("final_logit_softcapping"):
        return "has no logit softcapping"
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or config.get(
            "use_bidirectional_attention"):
        return "uses tanh-GELU and causal attention"
    return None


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters (transformers 5: `rope_parameters`; before: `rope_theta` and `rope_scaling`); for a
    model with per-layer-type parameters (Gemma 3), the global layers' (llama.cpp's `rope.freq_base`)."""
    rope = dict(config.get("rope_scaling") or {})
    params = config.get("rope_parameters") or {}
    rope.update(params.get("full_attention", params))
    if "rope_theta" in config:
        rope.setdefault("rope_theta", config["rope_theta"])
    if "type" in rope:
        rope.setdefault("rope_type", rope["type"])
    return rope


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Before any work: GGUF's blocks are 32 input columns, each under one scale; asymmetric 8-bit has no type."""
    if in_f % blocks.BLOCK:
        raise InputError(f"{name}: --format gguf stores rows in blocks of {blocks.BLOCK} and its {in_f} input features "
                         f"are not a multiple of {blocks.BLOCK}; --ignore it or use another --format")
    if spec.group_size not in (-1, 0) and spec.group_size % blocks.BLOCK:
        raise InputError(f"--format gguf needs a group size that is a multiple of {blocks.BLOCK} (or -1), "
                         f"got {spec.group_size}")
    if not spec.sym and spec.bits >= 8:
        raise InputError("--format gguf: asymmetric 8-bit codes have no exact GGUF type; use --sym, or 4 bits")


def writer(model: nn.Module, dtype: torch.dtype, specs: dict[str, QuantSpec], meta: dict[str, Any],
           qweights: Any) -> Any:
    """The checkpoint beside model.gguf: GPTQ format (symmetric or with zero points, any group), marked
    `gguf` so that the pipeline exports it once it is written and verified."""
    from geminicompress.formats import gptq

    gguf_arch(model.config.to_dict())
    packed = gptq.writer(model, dtype, specs, meta, qweights)
    packed.gguf = True
    return packed


def export(out: Path, options: GGUFOptions | None = None, source_gguf: Path | None = None,
           dest: Path | None = None) -> dict[str, Any]:
    """Write the checkpoint in `out` as `dest` (default OUT/model.gguf); tokenizer metadata copied from
    `source_gguf` when given, else built from OUT's tokenizer. Returns what report.json says of it."""
    options = options or GGUFOptions()
    dest = dest or out / FILE
    config = json.loads((out / "config.json").read_text())
    arch = gguf_arch(config)
    tmp = dest.with_name(f".{dest.name}.partial")
    writer = gguf.GGUFWriter(tmp, arch.name, use_temp_file=True)
    try:
        _metadata(writer, config, arch)
        vocab = config.get("vocab_size")
        if source_gguf is not None:
            copy_tokenizer(writer, source_gguf)
            tokenizer = f"copied from {source_gguf.name}"
        else:
            tokenizer = f"built ({build_tokenizer(writer, out, vocab)})"
            if arch.name == "gemma3":  # llama.cpp's converter: Gemma's SentencePiece adds no space prefix
                writer.add_add_space_prefix(False)
        stats = _tensors(writer, out, config, arch, options)
        writer.add_file_type(gguf_mix.FTYPES[options.mix] if options.mix in gguf_mix.FTYPES else
                             _FILE_TYPES.get(stats["types"].most_common(1)[0][0], gguf.LlamaFileType.GUESSED))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, dest)
    warning = (BUILT_GEMMA_TOKENIZER if source_gguf is None and arch.name == "gemma3" else None)
    return {"file": dest.name, "bytes": dest.stat().st_size, "tokenizer": tokenizer,
            **({"tokenizer_warning": warning} if warning else {}),
            "types": {t.name: n for t, n in stats["types"].items()}, "exact": stats["exact"],
            **({"q4_1_max_m_error_steps": round(stats["q4_1_err"], 6)} if stats["q4_1_err"] else {})}


BUILT_GEMMA_TOKENIZER = (
    "the tokenizer metadata built from Gemma's tokenizer.json does not split text as transformers does in "
    "llama.cpp (its SentencePiece scores are only in tokenizer.model); scores from token ids are unaffected, but "
    "for llama.cpp's own tokenization quantize from the model's .gguf file, whose tokenizer is copied")


_FILE_TYPES = {Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
               Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
               Q.F16: gguf.LlamaFileType.MOSTLY_F16, Q.F32: gguf.LlamaFileType.ALL_F32}


def _metadata(w: gguf.GGUFWriter, config: dict[str, Any], arch: GGUFArch) -> None:
    """The hyperparameters llama.cpp reads for the llama/qwen2/gemma3 architectures (the converter's TextModel)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = _rope(config)
    w.add_name(str(config.get("_name_or_path") or config.get("_model_name_or_path") or config["model_type"]))
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def llama3_rope_factors(config: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's per-frequency rope divisors (head_dim / 2,), as llama.cpp's converter writes them in
    `rope_freqs.weight`: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    rope = _rope(config)
    base = float(rope.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = (float(rope.get("factor", 8.0)), float(rope.get("low_freq_factor", 1.0)),
        float(rope.get("high_freq_factor", 4.0)))
    old = float(rope.get("original_max_position_embeddings", 8192))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _tensors(w: gguf.GGUFWriter, out: Path, config: dict[str, Any], arch: GGUFArch,
             options: GGUFOptions) -> dict[str, Any]:
    """Every tensor of OUT into `w`, one module at a time."""
    from geminicompress.formats import module_reader

    names = gguf.get_tensor_name_map(arch.arch, config["num_hidden_layers"])
    reader = module_reader(out, config)
    heads = {"q_proj": config["num_attention_heads"],
             "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
    tied = bool(config.get("tie_word_embeddings", False))
    stats: dict[str, Any] = {"types": Counter(), "exact": True, "q4_1_err": 0.0}
    with ExitStack() as stack:
        files = {}
        for file in weight_files(out):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            files.update(dict.fromkeys(handle.keys(), handle))
        modules = reader.modules(files) if reader is not None else {}
        owned = {k for keys in modules.values() for k in keys}
        kept = read_blocks(out)  # --gguf-type: the blocks as the stage chose them
        owned |= {f"{m}.weight" for m in kept}

        def add(hf_name: str, enc: blocks.Encoded) -> None:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise GeminiError(f"{hf_name}: no GGUF tensor name for it in the {arch.name} architecture")
            kind = hf_name.rsplit(".", 2)[-2] if "." in hf_name else ""
            if arch.permute_qk and kind in heads:
                enc = blocks.permute_rows(enc, blocks.qk_permutation(enc.shape[0], heads[kind]))
            w.add_tensor(name, enc.data, raw_shape=enc.data.shape if enc.qtype in (Q.F16, Q.F32) else None,
                         raw_dtype=None if enc.qtype in (Q.F16, Q.F32) else enc.qtype)
            stats["types"][enc.qtype] += 1
            if enc.qtype == Q.Q4_1:
                stats["q4_1_err"] = max(stats["q4_1_err"], enc.max_step_error)

        for module, keys in modules.items():
            built = reader.module(module, {k: files[k].get_tensor(k) for k in keys}, torch.float32)
            qw, bias, exact = codes_of(built)
            stats["exact"] &= exact
            add(f"{module}.weight", blocks.encode_quantized(qw, options.asym))
            if bias is not None:
                add(f"{module}.bias", blocks.encode_float(bias, Q.F32))
        for module, (type_name, cols, data) in kept.items():
            add(f"{module}.weight", blocks.Encoded(data, getattr(Q, type_name), (data.shape[0], cols)))
        if _rope(config).get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", llama3_rope_factors(config).numpy())
            stats["types"][Q.F32] += 1
        for key, handle in files.items():
            if key in owned or (tied and key == "lm_head.weight"):
                continue
            tensor = handle.get_tensor(key)
            if arch.norm_shift and key.endswith("norm.weight"):
                tensor = tensor.float() + arch.norm_shift
            add(key, _encode_float(key, tensor, _float_type(key, tensor, options, config)))
    return stats


def _encode_float(key: str, tensor: torch.Tensor, qtype: Q) -> blocks.Encoded:
    """A float tensor as `qtype`: F32/F16/Q8_0 as before, any other type (a mix's embedding) by llama-quantize's
    rounding without an importance matrix (gguf_blocks.rtn_bytes)."""
    if tensor.dim() < 2 or qtype in (Q.F32, Q.F16, Q.Q8_0):
        return blocks.encode_float(tensor, qtype)
    w = tensor.float().numpy()
    return blocks.Encoded(rtn_bytes(w, qtype.name), qtype, tuple(w.shape))


def _float_type(key: str, tensor: torch.Tensor, options: GGUFOptions, config: dict[str, Any] | None = None) -> Q:
    if tensor.dim() < 2:
        return Q.F32
    if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
        if options.mix and config is not None:  # llama-quantize's type for the embedding and the head
            return getattr(Q, embedding_type(key, tensor.shape[1], options.mix, config))
        return {"q8_0": Q.Q8_0, "f16": Q.F16, "f32": Q.F32}[options.embeddings]
    return blocks.FLOAT_TYPES[options.floats]


def embedding_type(key: str, cols: int, mix: str, config: dict[str, Any]) -> str:
    """The type llama-quantize's `mix` gives the token embedding or the output head (--gguf-type auto: its base
    mix's, core/gguf_config.AUTO_BASE)."""
    name = "output.weight" if key == "lm_head.weight" else "token_embd.weight"
    tied = bool(config.get("tie_word_embeddings", False))
    model = gguf_mix.Model(config["num_hidden_layers"], 1, True)
    return gguf_mix.tensor_type(name, cols, None, AUTO_BASE if mix == AUTO else mix, model, tied)


def fixed_bytes(model: nn.Module, quantized: list[str], tokenizer: Any) -> float:
    """Bytes of a `--gguf-type auto` file besides its quantized linears, counted before it is written: every
    other tensor at the type the export gives it (norms F32, the embedding and head as AUTO_BASE types them,
    other float linears F16; a tied head once), the tokenizer's metadata (each token and merge a string of
    8 + its bytes, a float32 score and an int32 type per token) and ~64 bytes of header per tensor."""
    config = model.config.to_dict()
    skip = {f"{n}.weight" for n in quantized}
    tied = bool(config.get("tie_word_embeddings", False))
    total, seen, count = 0.0, set(), 0
    for key, t in model.state_dict(keep_vars=True).items():
        if key in skip or id(t) in seen or (tied and key == "lm_head.weight"):
            continue
        seen.add(id(t))
        count += 1
        if t.dim() < 2:
            total += 4 * t.numel()
        elif key.endswith("embed_tokens.weight") or key == "lm_head.weight":
            total += t.numel() * blocks_bits(embedding_type(key, t.shape[1], AUTO, config)) / 8
        else:
            total += 2 * t.numel()
    return total + 64 * (count + len(quantized)) + _tokenizer_bytes(tokenizer)


def _tokenizer_bytes(tokenizer: Any) -> int:
    """What the tokenizer's metadata costs in a GGUF file (gguf_vocab.py writes it): each token a string of 8 + its
    bytes; a SentencePiece-style BPE (byte fallback) a float32 score and an int32 type per token and no merges, a
    byte-level BPE an int32 type per token and its merges (each a string of 8 + its bytes)."""
    if tokenizer is None:
        return 0
    tokens = list(tokenizer.get_vocab())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str()).get("model", {}) if backend is not None else {}
    sentencepiece = bool(model.get("byte_fallback"))
    size = sum(8 + len(t.encode("utf-8")) for t in tokens) + (8 if sentencepiece else 4) * len(tokens)
    if not sentencepiece:
        merges = model.get("merges") or []
        size += sum(8 + len((" ".join(m) if isinstance(m, list) else m).encode("utf-8")) for m in merges)
    return size + 4096


def mix_types(config: dict[str, Any], shapes: dict[str, tuple[int, int]], mix: str, imatrix: bool) -> dict[str, str]:
    """{module: GGUF type name} that llama-quantize's `mix` gives the linears `shapes` {module: (out, in)} of a
    model of `config`, with or without an importance matrix ("F16": llama.cpp keeps it in float)."""
    arch = gguf_arch(config)
    n = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch.arch, n)
    heads = config["num_attention_heads"]
    model = gguf_mix.Model(n, heads // (config.get("num_key_value_heads") or heads), imatrix)
    tied = bool(config.get("tie_word_embeddings", False))
    found = {}
    for module, (_, in_f) in shapes.items():
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None:
            raise GeminiError(f"{module}: no GGUF tensor name for it in the {arch.name} architecture")
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        found[module] = gguf_mix.tensor_type(name, in_f, layer, gguf_mix.check_mix(mix), model, tied)
    return found


def codes_of(module: nn.Module) -> tuple[QuantizedWeight, torch.Tensor | None, bool]:
    """(the codes, the bias, whether the scales are fp16 values) of a quantized module our readers build:
    a `DequantLinear` (gptq, awq, pack-quantized) or an INT8 module (int-quantized: zero 128 on 8 bits)."""
    if hasattr(module, "zeros") and hasattr(module, "g_idx"):
        qw = QuantizedWeight(module.q, module.scales.float(), module.zeros, module.g_idx,
                             QuantSpec(module.bits, -1, True))
    elif hasattr(module, "weight_scale"):
        codes = module.weight.to(torch.int32) + 128  # (out, in)
        qw = QuantizedWeight(codes, module.weight_scale.float(), torch.full_like(module.weight_scale, 128,
                             dtype=torch.int32), torch.zeros(codes.shape[1], dtype=torch.int32), QuantSpec(8, -1, True))
    else:
        raise GeminiError(f"a {type(module).__name__} has no codes GGUF can hold")
    exact = bool((qw.scales.to(torch.float16).float() == qw.scales).all())
    bias = getattr(module, "bias", None)
    return qw, (bias.detach() if bias is not None else None), exact
