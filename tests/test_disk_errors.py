"""The user's disk is not our bug (issue #34): a full disk, a quota, a read-only filesystem, no permission on OUT
are one line each, exit 2 when found before the work (OUT's estimated size against the free disk, a folder that
cannot be created), exit 1 during it, saying what was being written, the free space and the partial run's fate.

Simulated: the write functions raise the OS error (the tests run as root here, for which a chmod'ed folder is
writable; a real tmpfs was checked by hand, docs/install.md)."""

from __future__ import annotations

import errno
import os

import pytest
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.host.diskerrors import DiskError, disk_errno, disk_error
from geminicompress.formats import shards as shards_mod
from geminicompress.host.output import partial_dir

runner = CliRunner()


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip() and "Writing model shards" not in line]
    assert len(lines) == 1, result.output
    assert "internal error" not in result.output
    return lines[0]


def test_disk_errno_reads_os_errors_and_safetensors_messages():
    assert disk_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert disk_errno(PermissionError(errno.EACCES, "Permission denied")) == errno.EACCES
    assert disk_errno(OSError(errno.ENOENT, "gone")) is None
    SafetensorError = type("SafetensorError", (Exception,), {})
    assert disk_errno(SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                      "\"No space left on device\" }) No space left on device (os error 28)")) == 28
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_errno(wrapped) == errno.EDQUOT
    err = disk_error(OSError(errno.EROFS, "Read-only file system", "/x/y"), "OUT")
    assert isinstance(err, DiskError) and err.exit_code == 1 and "read-only while writing /x/y" in str(err)


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
@pytest.mark.parametrize("code, said", [(errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "quota is exceeded"),
                                        (errno.EACCES, "permission denied")])
def test_a_disk_refusal_during_the_work_is_one_line_exit_1_and_the_run_resumes(sharded, tmp_path, monkeypatch,
                                                                               stream, code, said):
    out = tmp_path / "out"
    bytes_of, calls = shards_mod._bytes, []

    def refuse(t):
        calls.append(1)
        if len(calls) > 12:  # after the first layer's tensors
            raise OSError(code, os.strerror(code))
        return bytes_of(t)

    monkeypatch.setattr(shards_mod, "_bytes", refuse)
    args = ["prune", str(sharded), "-o", str(out), stream, "--threads", "1", "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    line = _one_line(result)
    assert said in line and "part-00001.data" in line and "free there" in line, line
    assert f"the partial run {partial_dir(out)}" in line and "rerun the same command to resume it" in line, line
    assert partial_dir(out).is_dir() and not out.exists()
    monkeypatch.undo()
    result = runner.invoke(app, args)  # space freed: the same command resumes and finishes
    assert result.exit_code == 0, result.output
    assert (out / "report.json").is_file() and not partial_dir(out).exists()


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_too_little_free_disk_is_refused_before_the_work(sharded, tmp_path, monkeypatch, stream):
    from geminicompress.engine import estimate

    monkeypatch.setattr(estimate, "free_bytes", lambda path: 1000)
    out = tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(sharded), "-o", str(out), "--method", "int8", stream, "-q"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert "not enough disk for out: it needs about" in line and "nothing was written" in line, line
    assert not partial_dir(out).exists() and not out.exists()


@pytest.mark.parametrize("code, said", [(errno.EACCES, "permission denied"), (errno.EROFS, "the filesystem is read-only")])
def test_an_output_folder_that_cannot_be_created_is_refused_before_the_work(sharded, tmp_path, monkeypatch, code,
                                                                            said):
    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".partial"):
            raise OSError(code, os.strerror(code), str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    out = tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(sharded), "-o", str(out), "--method", "int8", "-q"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert f"cannot write {partial_dir(out)}: {said}" in line and "nothing was written" in line, line
