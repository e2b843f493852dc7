"""The output-directory contract: complete or absent, never half-written, never clobbered by accident.

Everything is written into a hidden sibling `.<name>.partial` and renamed onto OUT only when complete.
An existing OUT is replaced only with `force=True`. The sibling's name is stable so that a killed run,
restarted with the same command, finds its `state/` folder there and resumes (GPTQ/AWQ layer by layer);
`state/` is kept only when the recipe fingerprint matches, and removed before the final rename.
Before that rename every file and folder gets the mode the umask gives new files (safetensors writes
its files 0600, which a serving process running as another user cannot read).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from geminicompress.errors import InputError

STATE_DIR = "state"
THREADS_FILE = "threads.json"
_FINGERPRINT = "fingerprint.txt"


def check_output_path(out: Path, force: bool) -> None:
    """Fail before any work when OUT exists (without --force) or cannot be created."""
    if out.exists() and not force:
        raise InputError(f"output {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} exists and is not a directory")
    if not out.resolve().parent.exists():
        raise InputError(f"the parent folder of output {out} does not exist")


def partial_dir(out: Path) -> Path:
    """The hidden sibling `.<name>.partial` that a run on OUT writes into."""
    return out.with_name(f".{out.name}.partial")


def final_name(partial: Path) -> str:
    """`.out.partial` -> `out`: the name the output will have once the run completes."""
    return partial.name.removeprefix(".").removesuffix(".partial")


class OutputDir:
    """`with OutputDir(out, force, fingerprint) as tmp:` write into `tmp`; renamed to `out` on success."""

    def __init__(self, out: Path | str, force: bool = False, fingerprint: str = "") -> None:
        self.out = Path(out)
        self.force = force
        self.fingerprint = fingerprint
        self.tmp = partial_dir(self.out)
        self.state_dir = self.tmp / STATE_DIR

    def __enter__(self) -> Path:
        check_output_path(self.out, self.force)
        stamp = self.state_dir / _FINGERPRINT
        resumable = stamp.is_file() and stamp.read_text() == self.fingerprint and self.fingerprint
        if not resumable:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(self.fingerprint)
        # Anything but state/ from an earlier attempt is stale: the stages write it again.
        for child in self.tmp.iterdir():
            if child.name != STATE_DIR:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            apply_umask(self.tmp)
            if self.out.exists():
                shutil.rmtree(self.out)
            self.tmp.rename(self.out)
            return False
        if not self._has_resume_state() or issubclass(exc_type, InputError):
            shutil.rmtree(self.tmp, ignore_errors=True)  # bad input: the same command would stop there again
        # else: keep the hidden partial folder so that the same command resumes from its state/
        return False

    def _has_resume_state(self) -> bool:
        if not self.fingerprint or not self.state_dir.is_dir():
            return False
        return any(p.is_file() and p.name not in (_FINGERPRINT, THREADS_FILE) for p in self.state_dir.rglob("*"))


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it the modes `open`/`mkdir` would: 0666 & ~umask for files,
    0777 & ~umask for folders, whatever mode the library that wrote a file chose."""
    mask = os.umask(0o022)  # the only portable way to read the umask is to set it; put it back at once
    os.umask(mask)
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    os.chmod(root, dir_mode)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), dir_mode)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def resume_threads(out: Path, fingerprint: str) -> int | None:
    """The torch thread count of the interrupted run that a run on `out` with this fingerprint resumes, or None
    (no such run). A resumed run uses it unless told otherwise: results can depend on the thread count."""
    state = partial_dir(Path(out)) / STATE_DIR
    try:
        if (state / _FINGERPRINT).read_text() == fingerprint and fingerprint:
            return int(json.loads((state / THREADS_FILE).read_text())["threads"])
    except (OSError, ValueError, KeyError):
        pass
    return None
