"""The rows of the serving table, per engine: what each row adds to the stack (stack.py decides which rows
stay in it), in that engine's terms.

| row | transformers engine (this process, hf.py) | vLLM engine (vllm_driver.py) |
|---|---|---|
| original configuration | eager attention, whole prompts, one request at a time | prefix caching off, max_num_seqs 1 |
| prompt truncation | prompts cut to --max-prompt-len | same |
| FlashAttention | attn_implementation="sdpa" | the FLASH_ATTN backend (CUDA); CPU: one backend only |
| KV-cache reuse | the shared prefix's KV cache reused | enable_prefix_caching |
| dynamic batching | waiting requests batched (--max-batch) | max_num_seqs = --max-batch |
| PagedAttention | continuous batching on the paged cache | always on in vLLM: no switch |
| INT8 (W8A8) | the W8A8 model (--int8), fbgemm | the W8A8 model |
| INT4 (GPTQ) | the GPTQ model (--int4) through torch's int4 kernel (bf16 activations) | the GPTQ model |
| distilled student | the student (--student) in place of the teacher | the student |
| speculative decoding | the draft (--draft) proposes DRAFT_TOKENS tokens, the model verifies them in one forward (draft_loop.py, greedy, one request at a time) | not wired here |

llama.cpp's rows are in llama_server.py. A row whose mechanism cannot be switched on with this engine and device, or whose model was not given, is
kept with the reason and not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# proposals a verification round of the transformers engine's speculative row (draft_loop.py): 3, so that on an
# AMD CPU the verification's k + 1 = 4 rows stay on the few-rows route (kernels/cpu_dense.py); on the demo with its
# INT4 draft, 8 requests alone, k = 3 was the fastest in each draft-token study there
# (benchmarks/studies/serving/draft_tokens.py: 0.67x the verifier alone against 0.81x at k = 4, docs/serving.md);
# on an Intel Xeon, with torch's routes, k = 3 and 4 are within 4% (1.02x, 0.98x: speculation does not pay there)
DRAFT_TOKENS = 3  # (the llama.cpp engine has its own, 4: llama_server.py)

ROWS = ("original configuration", "prompt truncation", "FlashAttention", "KV-cache reuse", "dynamic batching",
        "PagedAttention", "INT8 (W8A8)", "INT4 (GPTQ)", "distilled student", "speculative decoding")
MODELS = {"INT8 (W8A8)": "int8", "INT4 (GPTQ)": "int4", "distilled student": "student"}  # rows serving another model
MISSING = {"int8": "no W8A8 model given (--int8 OUT, from `quantize MODEL -o OUT --method w8a8`)",
           "int4": "no GPTQ model given (--int4 OUT, from `quantize MODEL -o OUT --method gptq`)",
           "student": "no student given (--student OUT, from `distill --teacher MODEL --student-layers N -o OUT`)",
           "draft": "no draft model given (--draft OUT: a student or a quantized copy of MODEL)"}


@dataclass
class Row:
    name: str
    change: str  # what this row adds, in the engine's terms
    flags: dict = field(default_factory=dict)  # the engine flags this row adds to the stack's
    model: str = "base"  # "base", "int8", "int4", "student"; the speculative row serves "base" with the draft
    reason: str | None = None  # why it is not measured (cannot be switched here, or its model not given)


def rows_of(steps: list[tuple[dict, str]], given: dict[str, str | None]) -> list[Row]:
    """One row per ROWS name from its (flag change, description) step; a row whose model (or draft) was not
    given says so."""
    rows = []
    for name, (change, text) in zip(ROWS, steps):
        row = Row(name, text, dict(change), MODELS.get(name, "base"))
        need = "draft" if change.get("draft") else row.model
        if need != "base" and given.get(need) is None:
            row.reason = MISSING[need]
        rows.append(row)
    return rows


def hf_rows(max_batch: int, given: dict[str, str | None]) -> list[Row]:
    """The transformers engine's rows (all switchable on a CPU; the model rows need their model)."""
    steps = [({}, "attn_implementation=eager, whole prompts, one request at a time, DynamicCache"),
             ({"truncate": True}, "prompts cut to --max-prompt-len (the prefix kept)"),
             ({"attn": "sdpa"}, "attn_implementation=sdpa (torch's flash-attention kernel)"),
             ({"prefix_cache": True}, "the shared prefix's KV cache computed once and reused"),
             ({"max_batch": max_batch}, f"requests waiting are served together, up to {max_batch}"),
             ({"paged": True}, "transformers continuous batching (init_continuous_batching) on its paged cache, "
                               "prefix blocks shared"),
             ({}, "the W8A8 checkpoint (fbgemm INT8 GEMMs)"),
             ({}, "the GPTQ checkpoint through torch's int4 kernel (bf16 activations)"),
             ({}, "the distilled student served in place of the teacher"),
             ({"draft": True, "max_batch": 1, "prefix_cache": False, "paged": False},
              f"the draft proposes {DRAFT_TOKENS} tokens, the model verifies them in one forward (greedy), one "
              "request at a time")]
    return rows_of(steps, given)


def vllm_rows(max_batch: int, given: dict[str, str | None], on_cuda: bool) -> list[Row]:
    """The vLLM engine's rows: engine arguments added to the stack's."""
    attn_off = {"attention_backend": "TRITON_ATTN"} if on_cuda else {}
    steps = [({**attn_off, "enable_prefix_caching": False, "max_num_seqs": 1}, "prefix caching off, max_num_seqs=1"),
             ({"truncate": True}, "prompts cut to --max-prompt-len (the prefix kept)"),
             ({"attention_backend": "FLASH_ATTN"} if on_cuda else {}, "attention_backend=FLASH_ATTN"),
             ({"enable_prefix_caching": True}, "enable_prefix_caching=True"),
             ({"max_num_seqs": max_batch}, f"max_num_seqs={max_batch}"),
             ({}, "PagedAttention"),
             ({}, "the W8A8 checkpoint"),
             ({}, "the GPTQ checkpoint"),
             ({}, "the distilled student in place of the teacher"),
             ({"draft": True}, "speculative decoding")]
    rows = rows_of(steps, given)
    if not on_cuda:
        rows[2].reason = "vLLM's CPU build has one attention backend (CPU_ATTN), used in every row"
    rows[5].reason = "vLLM's KV cache is paged in every row: there is no switch to turn it off"
    rows[9].reason = rows[9].reason or "speculative decoding through vLLM (speculative_config) is not wired here"
    return rows
