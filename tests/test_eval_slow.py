"""Real-model check (run with `pytest -m slow`): our perplexity on the demo model equals a plain
transformers loop over the same wikitext2 windows to 4 significant digits."""

import math

import pytest
import torch
from conftest import DATA

from geminicompress.eval.api import evaluate
from geminicompress.eval.config import EvalStage

pytestmark = pytest.mark.slow


@torch.no_grad()
def test_demo_perplexity_matches_plain_transformers_loop():
    from geminicompress.models.loading import load_model

    text_path = DATA / "wikitext2-test.txt"
    if not text_path.is_file():
        pytest.skip(f"{text_path} is not on this machine")
    demo = load_model("smollm2-demo")
    ids = demo.tokenizer(text_path.read_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :2048]
    losses = [demo.model(w, labels=w).loss.item() for w in ids.split(512, dim=1)]
    plain = math.exp(sum(losses) / len(losses))
    opts = EvalStage(type="eval", seq_len=512, max_tokens=2048, latency=False)
    ours = evaluate([], "smollm2-demo", str(text_path), None, opts)["models"][0]["quality"]
    assert ours["windows"] == 4 and ours["tokens"] == 4 * 511
    assert f"{ours['perplexity']:.4g}" == f"{plain:.4g}"
