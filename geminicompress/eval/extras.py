"""Optional measurements: downstream tasks through lm-eval-harness (a package of its own, installed
apart), and speculative decoding with a draft model (geminicompress.eval.speculative, written with the
distillation code). Each is skipped with one clear line when it is not available.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from geminicompress.core.errors import GeminiError
from geminicompress.models.loading import load_model
from geminicompress.host.progress import Progress


def tasks_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def run_tasks(model, tokenizer, tasks: list[str], device: torch.device, note: Callable[[str], None]) -> dict | None:
    """Downstream task scores through lm-eval-harness's Python API: {task: {metric: value}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device=str(device))
        results = simple_evaluate(model=lm, tasks=list(tasks))
    except Exception as exc:  # lm-eval raises many unrelated types (offline hub, unknown task names)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        note(f"lm-eval tasks {','.join(tasks)} failed: {reason}")
        return None
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in (results or {}).get("results", {}).items()}


def run_speculative(baseline: str, options, base, device: torch.device, progress: Progress, load: dict) -> dict:
    """Speculative decoding of the baseline (teacher) with `options.draft`; {"available": False, ...} if not possible."""
    try:
        module = importlib.import_module("geminicompress.eval.speculative")
        measure = module.measure_speculative
    except (ModuleNotFoundError, AttributeError):
        progress.warn("--draft: speculative decoding is not available in this installation: skipped")
        return {"available": False, "reason": "geminicompress.eval.speculative is not available"}
    if base is None or base.ids.numel() == 0:
        progress.warn("--draft: no baseline tokens to build a prompt from: skipped")
        return {"available": False, "reason": "no prompt"}
    try:
        teacher = load_model(baseline, **load)
        draft = load_model(options.draft, **load)
    except GeminiError as exc:
        progress.warn(f"--draft: {exc}: skipped")
        return {"available": False, "reason": str(exc)}
    prompt = base.ids[: options.prompt_len].view(1, -1).to(device)  # (1, P)
    progress.info(f"speculative decoding: {baseline} with draft {options.draft}")
    result = measure(teacher.model.to(device), draft.model.to(device), teacher.tokenizer, prompt,
                     options.gen_len, options.repeats, options.warmup)
    return {"available": True, "teacher": baseline, "draft": options.draft, **dict(result)}
