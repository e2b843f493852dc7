"""An eval stage's config (`type: eval` in a recipe, and `geminicompress eval`'s options): what is measured,
on which engine, and the serving table's workload."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from geminicompress.core.config import StageBase as _StageBase
from geminicompress.core.config import Strict
from geminicompress.data.windows import Frame

class ServingOptions(Strict):
    """The serving table (`serve-bench`) of the recipe's model, inside an eval stage: one workload, one row
    per serving optimization, each added to the best row above it; the recipe's output takes the rows it
    applies to: INT8 when W8A8, INT4 when 4-bit, the student (and the draft) when the recipe distills, the
    draft when 4-bit (docs/serving.md)."""

    requests: int = Field(32, ge=1, description="requests in the workload")
    prefix_len: int = Field(256, ge=0, description="tokens of the system prefix every request shares")
    question_len: int = Field(128, ge=1, description="tokens of each request's own question")
    answer_len: int = Field(32, ge=2, description="tokens generated per request (greedy, EOS ignored)")
    rate: float | None = Field(None, gt=0, description="arrivals per second of the timed rows (Poisson), instead "
                               "of `load`")
    load: float | None = Field(None, gt=0, lt=1, description="the timed rows' arrival rate as a share of the stack's "
                               "capacity measured in the same run (default 0.7)")
    concurrency: int | None = Field(None, ge=1, description="the timed rows as N clients in a closed loop, instead "
                                    "of `load`")
    max_prompt_len: int | None = Field(None, ge=1, description="the truncation row's prompt length "
                                       "(default: prefix + half the question)")
    max_batch: int = Field(8, ge=2, description="largest batch of the batching rows (vLLM: max_num_seqs)")
    ppl_tokens: int = Field(4096, ge=0, description="tokens of the eval text for the perplexity of rows that "
                            "change the model")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    seed: int = 0


class EvalStage(_StageBase):
    """Quality drift vs latency gain of the pipeline's output against the recipe's input model.
    `data` is the evaluation text (default: the recipe's calibration data)."""

    type: Literal["eval"]
    text_column: str = "text"
    seq_len: int | None = Field(None, ge=8, description="default: min(2048, the model's context)")
    max_tokens: int | None = Field(None, ge=8)
    prompt_len: int | None = Field(None, ge=1, description="default: 128 on a CPU, 512 on a GPU")
    gen_len: int | None = Field(None, ge=1, description="default: 32 on a CPU, 128 on a GPU")
    batch_sizes: list[int] | None = Field(None, description="default: [1, 4] on a CPU, [1, 4, 8] on a GPU")
    repeats: int | None = Field(None, ge=1, description="default: 3 on a CPU, 5 on a GPU")
    warmup: int = Field(1, ge=0)
    latency: bool = Field(True, description="false = quality only")
    quality: bool = Field(True, description="false = latency only (no perplexity, KL, agreement)")
    tasks: list[str] = Field(default_factory=list, description="lm-eval-harness tasks (optional extra)")
    draft: str | None = Field(None, description="draft MODEL: also time speculative decoding of the baseline")
    kernels: Literal["fast", "reference"] = Field(
        "fast", description="fast: each format's kernel on this device (torch's int4 kernel for GPTQ/AWQ/"
        "pack-quantized, bf16 activations); reference: our dequantizing loader, latency not measured for packed formats")
    dtype_baseline: bool = Field(True, description="when a model runs in another activation dtype than the baseline "
                                 "(int4 kernels: bf16), also time the baseline in that dtype")
    engine: Literal["transformers", "vllm", "llama.cpp"] = Field("transformers", description="llama.cpp: load and measure "
                                                                "every model in llama.cpp (GGUF files or our outputs); "
                                                                "vllm: load and measure every model in "
                                                    "vLLM (a separate install, docs/serving.md)")
    vllm_python: str | None = Field(None, description="python of the venv that has vLLM (default: this one if it "
                                    "imports vllm, else $GEMINICOMPRESS_VLLM_PYTHON)")
    llama_python: str | None = Field(None, description="python that has llama-cpp-python (default: this one if it "
                                     "imports llama_cpp, else $GEMINICOMPRESS_LLAMA_PYTHON)")
    frame: Frame | None = Field(None, description="how each evaluated window starts: tokenizer (its BOS where it "
                                "adds one) or text; default: the recipe's frame, tokenizer for `geminicompress eval`")
    serving: ServingOptions | None = Field(None, description="also build the serving table (serve-bench) with "
                                           "`engine`; its INT8 row serves the output when it is W8A8")

    @field_validator("batch_sizes")
    @classmethod
    def _check_batch_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError(f"batch sizes must be positive integers, got {v}")
        return v
