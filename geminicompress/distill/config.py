"""A distill stage's config (`type: distill` in a recipe): the student, the cut's plan and repair, the training
budget and loop, the losses."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from geminicompress.core.config import StageBase as _StageBase
from geminicompress.core.config import Strict

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
    makes_student: ClassVar[bool] = True
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
    train_embedding: bool = Field(False, description="train the student's input embedding even where its head is "
                                  "untied: by default an untied table that is the teacher's own stays frozen and is "
                                  "held once, shared with the teacher (no gradient, no optimizer state: 3.9 GiB of a "
                                  "128k x 2048 vocabulary) (distill/shared_embedding.py)")
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
