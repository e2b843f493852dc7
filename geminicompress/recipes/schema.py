"""The recipe schema: a typed, validated description of a compression pipeline.

A recipe names a model, a seed, default calibration data, and an ordered list of stages. Each stage
is a pydantic model with `extra="forbid"`, so a typo in a key is an error naming the key. Stages are
told apart by `type` (and, for `quantize`, by `method`): see `stage_tag`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from geminicompress.compress.prune.config import PruneStage
from geminicompress.core.config import StageBase as _StageBase
from geminicompress.core.config import Strict
from geminicompress.data.windows import Frame
from geminicompress.methods import METHODS


class Calibration(Strict):
    """Calibration text shared by every stage that needs activations (GPTQ, AWQ, SmoothQuant, Wanda, SparseGPT)."""

    data: str = Field("builtin:pydoc", description="DATA: file, hub dataset (name:config:split) or builtin:pydoc")
    text_column: str = "text"
    samples: int = Field(128, ge=1, le=100_000, description="number of calibration windows")
    seq_len: int = Field(512, ge=8, le=131_072, description="tokens per calibration window")


# --------------------------------------------------------------------------- distill

DEFAULT_STEPS = 200  # a distill stage's optimizer steps when no budget (steps, train_minutes, train_tokens) is given


class LossWeights(Strict):
    kl: float = Field(1.0, ge=0.0, description="forward KL on temperature-softened logits (x T^2)")
    reverse_kl: float = Field(0.0, ge=0.0)
    jsd: float = Field(0.0, ge=0.0)
    # 0.5 with T = 1 by default: on the demo's 24-layer student both lower the perplexity drift at the same KL
    # to the teacher (docs/distill.md, Losses: 44.60 -> 40.10 after 30 minutes; T = 2 and KL alone before)
    ce: float = Field(0.5, ge=0.0, description="cross-entropy on the data")
    hidden_mse: float = Field(0.0, ge=0.0)
    hidden_cos: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _some_loss(self) -> "LossWeights":
        if sum(self.model_dump().values()) <= 0:
            raise ValueError("at least one loss weight must be positive")
        return self

    @property
    def hidden(self) -> bool:
        """A hidden-state loss is on (it needs the teacher's hidden states and a layer map)."""
        return self.hidden_mse > 0 or self.hidden_cos > 0

    @property
    def teacher_logits(self) -> bool:
        """A loss on the teacher's logits is on (KL, reverse KL or JSD)."""
        return self.kl > 0 or self.reverse_kl > 0 or self.jsd > 0


def parse_latency(text: str | float) -> float:
    """'0.8x', '0.8' or 0.8 -> 0.8: a fraction of the teacher's time per output token, in (0, 1)."""
    try:
        value = float(str(text).strip().lower().removesuffix("x"))
    except ValueError as exc:
        raise ValueError(f"target_latency '{text}': give a fraction of the teacher's time per token, e.g. 0.8x") from exc
    if not 0.0 < value < 1.0:  # NaN fails too
        raise ValueError(f"target_latency {text}: a student must decode faster than its teacher; give a fraction in "
                         "(0, 1), e.g. 0.8x")
    return value


class DistillStage(_StageBase):
    """Knowledge distillation of the pipeline's model (or `teacher`) into a smaller student."""

    type: Literal["distill"]
    teacher: str | None = Field(None, description="teacher MODEL (default: the recipe's input model)")
    student: str | None = Field(None, description="an existing student MODEL sharing the teacher's tokenizer")
    student_layers: int | float | list[int] | None = Field(
        None, description="teacher layers the student keeps: a count (24), a fraction (0.8) or a list of indices")
    student_config: str | None = Field(None, description="a config.json for a student of the teacher's architecture")
    target_latency: float | None = Field(
        None, description="derive a student decoding in at most this fraction of the teacher's time per token "
        "('0.8x'): the layer count from the parameter share read per token (distill/latency_target.py)")
    mlp_ratio: float = Field(1.0, gt=0.0, le=1.0, description="keep this fraction of MLP channels")
    derive: Literal["measured", "even"] | None = Field(
        None, description="which layers a count or fraction keeps: measured (the cut with the least drift after "
        "repair on calibration windows, plan.json) or even (evenly spaced, first and last kept); default measured, "
        "even when the teacher streams")
    repair: Literal["down_proj", "linear", "none"] | None = Field(
        None, description="closed-form repair of the cut before training, merged into the down projection of the "
        "block before each cut: down_proj (refit it), linear (a ReplaceMe map) or none; default down_proj, none "
        "when the teacher streams")
    repair_objective: Literal["mse", "cosine"] = Field("mse", description="the linear map's objective (cosine: "
                                                       "refined by Adam from the least-squares map)")
    repair_follow: bool = Field(False, description="also refit the down projection of the kept blocks after a cut "
                                "towards the teacher's stream (lower hidden-state error, but measured worse perplexity "
                                "on the demo)")
    repair_ridge: float = Field(0.1, ge=0.0, description="ridge of the repair's least squares (x mean diagonal)")
    repair_windows: int = Field(32, ge=1, description="calibration windows the plan and the repair fit on")
    repair_synthetic: int = Field(0, ge=0, description="windows the teacher writes by sampling from the start of the "
                                  "calibration windows, added to the repair's fit (distill/synthetic.py: as good as "
                                  "as many more real windows on the demo; costs their generation and walk memory)")
    plan_held_windows: int = Field(4, ge=1, description="further calibration windows the plan measures drift on")
    plan_data: str | None = Field(None, description="text the plan's held-out windows come from: the kind of text "
                                  "the student will serve or be evaluated on (default: the calibration data)")
    plan_shortlist: int = Field(3, ge=1, description="cuts (least drift unrepaired) the plan repairs and measures")
    plan_search: Literal["candidates", "greedy"] = Field(
        "candidates", description="greedy: also remove blocks one at a time, each the one whose repaired removal "
        "costs the least held-out drift (distill/greedy.py; about (L-2) + (n-1) x plan_greedy_pool repaired "
        "evaluations), its set a candidate beside the fixed ones")
    plan_greedy_pool: int | None = Field(8, ge=1, description="candidates the greedy search tries per step after "
                                         "the first (the best of the step before; null: all)")
    train_minutes: float | None = Field(None, ge=0.0, description="train for this many minutes (0: stop after "
                                        "the cut and repair)")
    train_tokens: int | None = Field(None, ge=0, description="train on this many tokens (0: stop after the cut "
                                     "and repair)")
    reconstruct: bool = Field(False, description="before training a pruned student, refit its pruned linears to the "
                              "teacher's in closed form, layer by layer on calibration windows (masks kept)")
    steps: int | None = Field(None, ge=1, description=f"optimizer steps (default {DEFAULT_STEPS} when neither "
                              "train_minutes nor train_tokens is given; null with those)")
    seq_len: int = Field(512, ge=8)
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    temperature: float = Field(1.0, gt=0.0)
    loss: LossWeights = Field(default_factory=LossWeights)
    layer_map: dict[int, int] | None = Field(None, description="student layer -> teacher layer for hidden losses")
    topk_cache: int | None = Field(None, ge=1, description="cache the teacher's top-k logits on disk")
    teacher_stream: bool | None = Field(None, description="read the teacher one decoder layer at a time for the "
                                        "top-k cache, never whole (default: when its float32 weights exceed half "
                                        "the available memory and it can stream)")
    precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="mixed precision of the training loop; auto: bf16 where the device computes it "
        "natively (a GPU with bf16, a CPU with AVX-512 BF16 or AMX), else no (float32) (distill/precision.py)")
    gradient_checkpointing: bool = Field(True, description="activation checkpointing of the student's decoder "
                                         "layers (--checkpoint-layers, on by default): their activations are "
                                         "recomputed in the backward instead of kept (demo: 1.56 -> 0.11 GiB), for "
                                         "a second forward of the layers per step")
    head_chunk_mb: float = Field(96, gt=0, description="memory budget of the training head: the student's and "
                                 "teacher's logits and the losses go a chunk of positions at a time, as many as fit "
                                 "this many MB (distill/chunked_head.py)")
    freeze_prefix: bool = Field(False, description="freeze the student's leading blocks that equal the teacher's "
                                "(and the input embedding, with a head tied to it) and start the student's forward "
                                "from the teacher's hidden state after them: less work per token "
                                "(distill/shared_prefix.py)")
    restyle: float = Field(0.0, ge=0.0, le=1.0, description="the share of the training text rewritten in random "
                           "spellings, one per stretch of about 4k tokens (punctuation apart, a marker around "
                           "in-word hyphens, clitics apart, lower case): the student learns to read a spelling "
                           "from context as its teacher does (data/restyle.py); the held-out windows stay as they are")
    eval_every: int = Field(50, ge=1)
    eval_windows: int = Field(8, ge=1)
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0 = only at the end)")
    resume: bool = False

    @field_validator("student_layers")
    @classmethod
    def _check_layers(cls, v: int | float | list[int] | None) -> int | float | list[int] | None:
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"a student keeps at least 1 layer, got {v}")
        if isinstance(v, float) and not 0.0 < v <= 1.0:
            raise ValueError(f"a fraction of layers must be in (0, 1], got {v}")
        if isinstance(v, list) and (not v or len(set(v)) != len(v)):
            raise ValueError("a layer list must be non-empty without repeats")
        return v

    @field_validator("target_latency", mode="before")
    @classmethod
    def _parse_latency(cls, v: Any) -> Any:
        return None if v is None else parse_latency(v)

    @model_validator(mode="after")
    def _one_student(self) -> "DistillStage":
        names = ("student", "student_layers", "student_config", "target_latency")
        given = [n for n in names if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of student, student_layers, student_config, target_latency "
                             f"(got {', '.join(given)})")
        if self.topk_cache and self.loss.hidden:
            raise ValueError("topk_cache stores logits only; hidden-state losses need the teacher online (drop one)")
        budgets = [n for n in ("steps", "train_minutes", "train_tokens") if getattr(self, n) is not None]
        if len(budgets) > 1:
            raise ValueError(f"give one training budget of steps, train_minutes, train_tokens (got {', '.join(budgets)})")
        if not budgets:  # resolved here, so report.json and OUT/recipe.yaml say what ran (and load again)
            object.__setattr__(self, "steps", DEFAULT_STEPS)
        if self.teacher_stream and (self.derive == "measured" or self.repair not in (None, "none")):
            raise ValueError("derive: measured and repair need the teacher in memory (its calibration walk); with "
                             "teacher_stream use derive: even and repair: none")
        if self.repair_synthetic and (self.repair == "none" or self.teacher_stream
                                      or self.student is not None or self.student_config is not None):
            raise ValueError("repair_synthetic adds windows to the repair of a student cut from a teacher in memory: "
                             "it needs a student cut by student_layers or target_latency, a repair other than none "
                             "and no teacher_stream")
        return self

    @property
    def trains(self) -> bool:
        """False when a budget of 0 minutes or 0 tokens says: stop after the cut and repair."""
        return self.train_minutes != 0 and self.train_tokens != 0


# --------------------------------------------------------------------------- eval


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


# --------------------------------------------------------------------------- recipe


def stage_tag(value: Any) -> str | None:
    """Discriminator: 'quantize:<method>' for quantize stages, else the type."""
    get = value.get if isinstance(value, dict) else lambda k, d=None: getattr(value, k, d)
    kind = get("type")
    if kind == "quantize":
        return f"quantize:{get('method')}"
    return kind


STAGE_TYPES = ("quantize", "prune", "distill", "eval")
# Every stage's tag -> its config: the quantize methods come from the method registry.
STAGE_CONFIGS: dict[str, type[Strict]] = {
    **{f"quantize:{name}": m.config for name, m in METHODS.items()},
    "prune": PruneStage,
    "distill": DistillStage,
    "eval": EvalStage,
}

Stage = Annotated[
    Union[tuple(Annotated[cls, Tag(tag)] for tag, cls in STAGE_CONFIGS.items())],  # type: ignore[valid-type]
    Discriminator(
        stage_tag,
        custom_error_type="stage_type",
        custom_error_message=f"unknown stage: 'type' must be {', '.join(STAGE_TYPES)}, "
        f"and a quantize 'method' must be {', '.join(METHODS)}",
    ),
]


class Output(Strict):
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="dtype of float weights on disk")


class Recipe(Strict):
    description: str = ""
    model: str = Field(..., description="MODEL: hub id, local directory, .gguf file or smollm2-demo")
    seed: int = 0
    trust_remote_code: bool = False
    allow_pickle: bool = False
    allow_nonfinite: bool = Field(False, description="compress a model whose weights hold NaN/Inf anyway (by "
                                  "default that stops the run before any work; report.json records what was found)")
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads (default: the cores not busy "
                                "with other processes when the run starts); --threads overrides it")
    calibration: Calibration = Field(default_factory=Calibration)
    frame: Frame = Field("tokenizer", description="how every window the run builds starts (calibration, "
                         "distillation, eval): tokenizer: as the model's tokenizer starts a text (its BOS where it "
                         "adds one: Gemma, Llama 3, Mistral; nothing for SmolLM2, Qwen); text: text tokens only, "
                         "for text that is not a document start (data/windows.py)")
    stages: list[Stage] = Field(..., min_length=1)
    output: Output = Field(default_factory=Output)

    @model_validator(mode="after")
    def _eval_last(self) -> "Recipe":
        seen_eval = False
        for i, stage in enumerate(self.stages):
            if isinstance(stage, EvalStage):
                seen_eval = True
            elif seen_eval:
                raise ValueError(f"stage {i} ({stage.type}) comes after an eval stage; eval stages go last")
        return self
