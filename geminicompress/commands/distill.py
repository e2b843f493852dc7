"""`geminicompress distill`: a teacher into a smaller student (derived from it, or given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from geminicompress.commands import common as c
from geminicompress.core.errors import InputError


def _parse_layers(text: str) -> int | float | list[int]:
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        return int(text) if text.strip().isdigit() else float(text)
    except ValueError as exc:
        raise InputError(f"--student-layers '{text}': give a count (24), a fraction (0.8) or a list of layer "
                         "indices (0,2,4)") from exc


def _check_before_load(teacher: str, layers: int | float | list[int] | None, cuts: bool,
                       target_latency: float | None = None, mlp_ratio: float = 1.0) -> None:
    """Refuse, from the teacher's config.json alone, a layer count the teacher cannot give (or a student that
    would be a copy of it: every layer and every MLP channel kept), a latency target
    no layer count can give and (when the student is cut by measurement or repaired) an architecture whose
    blocks we cannot map."""
    from geminicompress.core.arch import arch_for
    from geminicompress.distill.latency_target import keep_for_latency
    from geminicompress.models.demo import demo_cache_dir
    from geminicompress.models.headers import read_config
    from geminicompress.models.lazy import skeleton
    from geminicompress.models.loading import resolve_model
    from geminicompress.distill.student import check_student_layers

    source = resolve_model(teacher)
    path = source.path if source.kind == "dir" else demo_cache_dir() if source.kind == "demo" else None
    config = read_config(path) if path is not None else None
    if config is None:
        return  # a hub id or .gguf: checked once it loads
    model_type = config.get("model_type")
    n_layers = config.get("num_hidden_layers")
    if layers is not None and isinstance(n_layers, int):
        check_student_layers(n_layers, layers, mlp_ratio)
    if cuts or target_latency is not None:  # the decoder blocks, traced on the config's skeleton (no weight read)
        try:
            model = skeleton(path, False)
            arch_for(model)
        except Exception as exc:  # transformers does not know the type, or tracing finds no decoder layers
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"teacher architecture '{model_type}' has no block map for cutting layers ({why}); "
                             "use --derive even --repair none") from exc
        if target_latency is not None:
            keep_for_latency(model, target_latency)


def _parse_loss(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        try:
            out[key.strip()] = float(value) if sep else 1.0
        except ValueError as exc:
            raise InputError(f"--loss '{text}': use name=weight pairs, e.g. kl=1,ce=0.5") from exc
    return out


def distill(
    teacher: str = typer.Option(..., "--teacher", help="Teacher MODEL: hub id, directory, .gguf, or smollm2-demo."),
    output: Path = c.OUT,
    student: Optional[str] = typer.Option(None, "--student", help="An existing student MODEL sharing the teacher's tokenizer (a pruned model keeps its zeros)."),
    student_layers: Optional[str] = typer.Option(None, "--student-layers", help="Derive the student: a count of teacher layers (24), a fraction (0.8) or indices (0,2,4,...)."),
    student_config: Optional[str] = typer.Option(None, "--student-config", help="A config.json for a student of the teacher's architecture."),
    target_latency: Optional[str] = typer.Option(None, "--target-latency", help="Derive a student decoding in at most this fraction of the teacher's time per token, e.g. 0.8x (the layer count from the parameter share read per token)."),
    plan_data: Optional[str] = typer.Option(None, "--plan-data", help="Text the plan measures each cut's drift on (the kind of text the student will serve; default DATA)."),
    mlp_ratio: Optional[float] = typer.Option(None, "--mlp-ratio", help="Keep this fraction of MLP channels in a derived student (default 1.0; with --student-layers 1.0, a width cut: every layer kept, narrower MLPs)."),
    derive: Optional[str] = typer.Option(None, "--derive", help="Which layers a count/fraction keeps: measured (the cut with the least drift after repair on calibration windows; writes plan.json) or even (evenly spaced). Default measured."),
    repair: Optional[str] = typer.Option(None, "--repair", help="Closed-form repair of the cut before training: down_proj (default), linear (a ReplaceMe map merged into down_proj) or none."),
    repair_synthetic: Optional[int] = typer.Option(None, "--repair-synthetic", help="The teacher writes N more repair windows by sampling from the start of the calibration windows (a better fit from little text; costs their generation and memory)."),
    train_minutes: Optional[float] = typer.Option(None, "--train-minutes", help="Train for N minutes (0: stop after the cut and repair)."),
    train_tokens: Optional[int] = typer.Option(None, "--train-tokens", help="Train on N tokens (0: stop after the cut and repair)."),
    reconstruct: Optional[bool] = typer.Option(None, "--reconstruct/--no-reconstruct", help="For a pruned student (--student PRUNED): first refit its pruned layers to the teacher's in closed form on calibration windows, then train (sparse recovery)."),
    data: Optional[str] = typer.Option(None, "--data", help="Training text (file, hub dataset, builtin:pydoc)."),
    text_column: str = c.TEXT_COLUMN,
    samples: Optional[int] = typer.Option(None, "--samples", help="Calibration windows of DATA for --reconstruct (default 128)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default 200)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per training window (default 512)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Windows per micro-batch (default 4)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches per optimizer step (default 1)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak AdamW learning rate (default 2e-4)."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Linear warm-up steps before cosine decay (default 20)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Softmax temperature of the KL losses (default 1.0; 2.0 before this release)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="Loss weights (default kl=1,ce=0.5; kl, reverse_kl, jsd, ce, hidden_mse, hidden_cos). A weight not named keeps its default: kl=1,ce=0 for KL alone."),
    topk_cache: Optional[int] = typer.Option(None, "--topk-cache", help="Cache the teacher's top-k logits on disk and reuse them."),
    teacher_stream: Optional[bool] = typer.Option(None, "--teacher-stream/--no-teacher-stream", help="Read the teacher one decoder layer at a time from disk to build the --topk-cache, never whole, so a teacher bigger than memory can teach (default: when its float32 weights exceed half the available memory; needs --topk-cache)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="Training precision: auto (default: bf16 where the device computes it natively, a GPU with bf16 or a CPU with AVX-512 BF16 or AMX: 1.6-2x tokens/s on the demo; else no), no (float32), bf16, fp16. The weights stay float32 (autocast): only the loop's matmuls change."),
    gradient_checkpointing: Optional[bool] = typer.Option(None, "--checkpoint-layers/--no-checkpoint-layers", help="Activation checkpointing of the student's layers (default on): recomputed in the backward, not kept (demo: 1.56 -> 0.11 GiB of activations, for a second forward of the layers)."),
    gradient_checkpointing_alias: Optional[bool] = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing", hidden=True, help="The former name of --checkpoint-layers."),
    head_chunk_mb: Optional[float] = typer.Option(None, "--head-chunk-mb", help="Memory budget (MB) of the training head: logits and losses go a chunk of positions at a time (default 96; at least 32 positions a chunk)."),
    freeze_prefix: Optional[bool] = typer.Option(None, "--freeze-prefix/--no-freeze-prefix", help="Freeze the student's leading blocks that are the teacher's own (and the embedding) and start its forward from the teacher's hidden state there: less work per token."),
    train_embedding: Optional[bool] = typer.Option(None, "--train-embedding/--no-train-embedding", help="Train the student's input embedding even where its head is untied (by default such a table, the teacher's own, stays frozen and is held once with the teacher: no gradient, no optimizer state; a tied one always trains)."),
    restyle: Optional[float] = typer.Option(None, "--restyle", help="Rewrite this share (0-1) of the training text in random spellings, one per stretch (punctuation apart, a marker around in-word hyphens, lower case...), so the student learns to read a spelling from context as its teacher does. The held-out windows stay as they are."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Held-out perplexity every N steps (default 50)."),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps for --resume (default: end only)."),
    resume: Optional[bool] = typer.Option(None, "--resume/--no-resume", help="Continue exactly from the last checkpoint of the same command."),
    **options: Any,
) -> None:
    """Distill TEACHER into a smaller, faster student (every other layer by default).

    \b
    Examples:
      geminicompress distill --teacher smollm2-demo --student-layers 24 \\
          --train-minutes 0 --data wiki.txt -o student
      geminicompress distill --teacher smollm2-demo --student-layers 0.5 \\
          --data wiki.txt -o student --steps 300
      accelerate launch -m geminicompress distill --teacher big-model \\
          --student small-model --data train.jsonl -o out
    """
    from geminicompress.distill.config import parse_latency

    try:
        latency = parse_latency(target_latency) if target_latency is not None else None
    except ValueError as exc:
        raise InputError(f"--{exc}".replace("target_latency", "target-latency", 1)) from exc
    given = {
        "student": student, "student_config": student_config, "mlp_ratio": mlp_ratio, "reconstruct": reconstruct,
        "data": data, "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum, "lr": lr,
        "warmup_steps": warmup_steps, "temperature": temperature, "topk_cache": topk_cache,
        "teacher_stream": teacher_stream, "precision": precision, "gradient_checkpointing": gradient_checkpointing if gradient_checkpointing is not None else gradient_checkpointing_alias, "head_chunk_mb": head_chunk_mb,
        "freeze_prefix": freeze_prefix, "train_embedding": train_embedding, "restyle": restyle, "eval_every": eval_every, "save_every": save_every, "resume": resume, "derive": derive, "repair": repair,
        "repair_synthetic": repair_synthetic,
        "train_minutes": train_minutes, "train_tokens": train_tokens, "plan_data": plan_data,
        "target_latency": latency,
        "student_layers": _parse_layers(student_layers) if student_layers is not None else None,
        "loss": _parse_loss(loss) if loss is not None else None,
    }
    stage = {"type": "distill", **{k: v for k, v in given.items() if v is not None}}
    if student is None and student_config is None:
        _check_before_load(teacher, given["student_layers"], derive != "even" or repair not in (None, "none"),
                           given["target_latency"], mlp_ratio if mlp_ratio is not None else 1.0)
    run = {**c.RUN_DEFAULTS, **options, "text_column": text_column, "samples": samples}
    c.run_single_stage(teacher, stage, output, run, source="distill options")


# the run options of quantize and prune that distill takes too (its DATA, --samples, --seq-len are its own, above)
DISTILL_RUN = {"seed", "force", "device", "trust_remote_code", "allow_pickle", "quiet", "threads"}
distill = c.handle_errors(c.with_options(distill, [p for p in c.RUN_OPTIONS if p.name in DISTILL_RUN], before=None))
