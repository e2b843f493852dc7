"""One writer per OUT (issue #34): a run holds an OS lock on OUT's partial folder for its whole life; a second run
on the same OUT refuses in one line (exit 2) naming the holder; the lock goes with the process, however it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geminicompress.core.errors import InputError
from geminicompress.host.output import LOCK_FILE, OutputDir, partial_dir

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_writer_in_the_same_process_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, fingerprint="abc") as tmp:
        assert (tmp / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(InputError, match=rf"another run \(pid {os.getpid()}\) is writing out"):
            OutputDir(out, fingerprint="abc").__enter__()
        (tmp / "x.txt").write_text("x")
    assert (out / "x.txt").is_file() and not (out / LOCK_FILE).exists() and not partial_dir(out).exists()


def test_the_lock_goes_with_the_run_and_a_kept_partial_resumes(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with OutputDir(out, fingerprint="abc") as tmp:
            (tmp / "state" / "layer.0").write_text("done")  # resume state: the partial folder is kept
            raise RuntimeError("killed")
    assert (partial_dir(out) / "state" / "layer.0").is_file()
    with OutputDir(out, fingerprint="abc") as tmp:  # the lock was released: this run takes over and resumes
        assert (tmp / "state" / "layer.0").read_text() == "done"


_SLOW_WRITER = """
import sys
from pathlib import Path
import time
from geminicompress.engine.sinks import ShardSink
finish = ShardSink.finish
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
def slow(self, i, layer, summary, kept):
    ready.write_text("writing")
    while not go.exists():
        time.sleep(0.05)
    return finish(self, i, layer, summary, kept)
ShardSink.finish = slow
sys.argv = ["geminicompress", *sys.argv[3:]]
from geminicompress.cli import app
app()
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_two_real_processes_on_one_out_one_writes_the_other_refuses(tiny_dir, tmp_path, stream):
    out = tmp_path / "same"
    ready, go = tmp_path / "ready", tmp_path / "go"
    args = ["quantize", str(tiny_dir), "-o", str(out), "--method", "int8", stream, "--threads", "1", "-q"]
    a = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(ready), str(go), *args], cwd=tmp_path,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # A holds the lock and is writing OUT's first layer
            if ready.exists() or a.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), a.communicate()
        b = subprocess.run([sys.executable, "-m", "geminicompress", *args], cwd=ROOT, env=_env(),
                           capture_output=True, text=True)
    finally:
        go.write_text("go")
        a_out, a_err = a.communicate(timeout=600)
    lines = [line for line in b.stderr.splitlines() if line.strip()]
    assert b.returncode == 2, b.stderr
    assert len(lines) == 1 and f"another run (pid {a.pid}) is writing same" in lines[0], b.stderr
    assert "internal error" not in b.stderr
    assert a.returncode == 0, a_err
    report = json.loads((out / "report.json").read_text())
    assert report["export"]["verified"]["max_abs_logit_diff"] <= report["export"]["verified"]["tolerance"]
    assert "skipped" not in report["export"]["verified"]
    assert not partial_dir(out).exists() and not (out / LOCK_FILE).exists()
    from geminicompress.models.loading import load_model

    load_model(str(out))  # OUT loads
