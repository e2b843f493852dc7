"""Tiny models and a tiny tokenizer built in-process: no downloads, a fraction of a second each.

`tiny_tokenizer()` trains a byte-level BPE (vocab 384) on Python's own pydoc topics text.
`tiny_model(kind)` builds a randomly initialised causal LM of the given architecture from a config.
`save_tiny(dir, kind)` writes both as a transformers directory.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

VOCAB = 384


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [topics[k] for k in sorted(topics)][:40]
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()))
    tok.eos_token = "<|endoftext|>"
    tok.bos_token = "<|endoftext|>"
    tok.pad_token = "<|endoftext|>"
    return tok


def tiny_config(kind: str = "llama", **overrides):
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0, tie_word_embeddings=False)
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        common.update(num_key_value_heads=2)
    if kind == "qwen3":
        common.update(head_dim=16)
    if kind == "gemma":
        common.update(num_key_value_heads=2, head_dim=16)
    if kind == "gpt_neox":
        common.update(rotary_pct=0.25, use_parallel_residual=True)
    common.update(overrides)
    return AutoConfig.for_model(kind, **common)


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    # Larger-than-default init so that logits are not all near-uniform and errors are measurable.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


def save_tiny(path: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    path = Path(path)
    tiny_model(kind, seed, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_sharded(path: Path, num_hidden_layers: int = 3, dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """A tiny Llama (config `overrides`) saved in `dtype` in ~60 KB shards with its tokenizer: a checkpoint that
    streams shard by shard (a decoder layer, ~150 KB in float32, straddles files)."""
    path = Path(path)
    tiny_model(num_hidden_layers=num_hidden_layers, **overrides).to(dtype).save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    return path


def prune_in_place(model, fraction: float = 0.5) -> dict:
    """Zero the `fraction` smallest |w| of every 2-D decoder-layer weight; return the keep-masks by name."""
    masks = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ".layers." in name:
                cut = p.abs().flatten().kthvalue(int(fraction * p.numel())).values
                masks[name] = p.abs() > cut
                p.mul_(masks[name])
    return masks
