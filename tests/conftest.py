import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test ever reaches a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_sharded, save_tiny, tiny_model, tiny_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint on disk (random weights, trained BPE tokenizer)."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def sharded(tmp_path_factory) -> Path:
    """A tiny Llama saved in bf16 in ~60 KB shards, 3 layers: every layer straddles two shards (tiny.save_sharded).
    Shared by the session: read it, never write into it."""
    return save_sharded(tmp_path_factory.mktemp("sharded") / "tiny-bf16", num_hidden_layers=3)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A few thousand words of real English prose (Python's docs) as a .txt file."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)[:30]))
    return path


@pytest.fixture
def tok():
    return tiny_tokenizer()


@pytest.fixture
def model():
    return tiny_model()


def _single_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls run faster on one thread, and the test machine is shared
    yield
    torch.set_num_threads(before)


# A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")` (each test on one torch
# thread) or "one_thread_module" (the whole module, its module-scoped fixtures included).
one_thread = pytest.fixture(_single_thread, name="one_thread")
one_thread_module = pytest.fixture(_single_thread, scope="module", name="one_thread_module")


class CrashAndResume:
    """The crash-and-resume harness: `kill(run)` runs `run()` with the sink failing as it finishes layer `at`
    (OUT's hidden partial folder then holds the resume state); `resume(run)` runs it again and returns its
    result with the layers the rerun finished (the others came back from the resume state)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from geminicompress.engine.sinks import ShardSink

        self.monkeypatch, self.sink, self.finish = monkeypatch, ShardSink, ShardSink.finish

    def kill(self, run, at: int = 2, error: BaseException = RuntimeError("killed")) -> None:
        finish = self.finish

        def crashing(sink, i, *rest):
            if i == at:
                raise error
            return finish(sink, i, *rest)

        self.monkeypatch.setattr(self.sink, "finish", crashing)
        try:
            with pytest.raises(type(error)):
                run()
        finally:
            self.monkeypatch.setattr(self.sink, "finish", finish)

    def resume(self, run) -> tuple[object, list[int]]:
        finish, seen = self.finish, []

        def recording(sink, i, *rest):
            seen.append(i)
            return finish(sink, i, *rest)

        self.monkeypatch.setattr(self.sink, "finish", recording)
        try:
            return run(), seen
        finally:
            self.monkeypatch.setattr(self.sink, "finish", finish)


@pytest.fixture
def crash_and_resume(monkeypatch) -> CrashAndResume:
    return CrashAndResume(monkeypatch)
