"""Greedy speculative decoding (eval/serving/draft_loop.py): the model's own greedy answer for any draft and any
number of proposals a round, every proposal accepted when the draft is the model, the caches cropped right."""

import pytest
import torch
from tiny import tiny_model

from geminicompress.eval.serving.draft_loop import greedy, speculative_greedy

pytestmark = pytest.mark.usefixtures("one_thread")
N, P = 17, 20


@pytest.fixture(scope="module")
def models():
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=512).eval()
    other = tiny_model("llama", seed=1, num_hidden_layers=2, vocab_size=512).eval()
    prompt = torch.randint(0, 512, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                         pad_token_id=0)[0, P:].tolist()
    return model, other, prompt, ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_answer_is_the_models_own_greedy_answer(models, k):
    model, other, prompt, ref = models
    for draft in (model, other):
        tokens, counts = speculative_greedy(model, draft, prompt, N, k)
        assert tokens == ref
        assert 1 + counts.accepted + counts.rounds == N  # the prefill's token, the accepted, one own a round


def test_the_loop_alone_gives_generates_greedy_answer(models):
    model, _, prompt, ref = models
    assert greedy(model, prompt, N) == ref
    assert greedy(model, prompt, 1) == ref[:1]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_model_as_its_own_draft_is_always_accepted(models, k):
    model, _, prompt, _ = models
    _, counts = speculative_greedy(model, model, prompt, N, k)
    assert counts.accepted == counts.proposed > 0
    assert counts.rounds == -(-(N - 1) // (k + 1))  # k + 1 tokens a round


def test_a_foreign_draft_is_rejected_and_the_first_token_is_reported(models):
    model, other, prompt, ref = models
    seen = []
    tokens, counts = speculative_greedy(model, other, prompt, N, 4, on_first=lambda: seen.append(len(seen)))
    assert seen == [0] and tokens == ref
    assert counts.accepted < counts.proposed and counts.rounds >= (N - 1) // 5
