"""The output-directory contract: complete or absent, never half-written, never clobbered by accident.

Everything is written into a hidden sibling `.<name>.partial` and renamed onto OUT only when complete.
An existing OUT is replaced only with `force=True`. The sibling's name is stable so that a killed run,
restarted with the same command, finds its `state/` folder there and resumes (GPTQ/AWQ layer by layer);
`state/` is kept only when the recipe fingerprint matches, and removed before the final rename.
Before that rename every file and folder gets the mode the umask gives new files (safetensors writes
its files 0600, which a serving process running as another user cannot read).

One writer per OUT: a run holds an exclusive OS lock (`fcntl.flock`) on `.<name>.partial/lock` from before it
looks at the partial folder until OUT is in place. The OS drops the lock when the process ends, however it ends,
so a killed run leaves nothing that blocks the next one; a second run while the first is alive refuses in one
line (exit 2) naming the holder's pid, which the holder writes into the lock file. A run resumes only a partial
folder whose lock it holds.

Never an input: before any work OUT is resolved (symbolic links followed) and compared with every path the run
reads (the caller's `inputs`); OUT that is one of them or holds one is refused in one line, with or without
force. OUT inside an input folder destroys nothing and is allowed. OUT that is a symbolic link is written through:
force replaces what it points to only when that is an output of ours (it holds one of OUR_FILES); a link to
anything else, or to nothing, is refused in one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from geminicompress.core.errors import InputError

STATE_DIR = "state"
THREADS_FILE = "threads.json"
_FINGERPRINT = "fingerprint.txt"
LOCK_FILE = "lock"


OUR_FILES = ("report.json", "serving.json", "sensitivity.json")  # one of them in a folder: a geminicompress output
Inputs = Iterable[tuple[str, "str | Path | None"]]  # (what it is, for the message: "model", "--data"; its path)


def check_output_path(out: Path | str, force: bool, inputs: Inputs = ()) -> Path:
    """Fail before any work when OUT is, holds or points to one of `inputs` (pairs (what, path); a spec that
    names no existing path, such as a hub id or builtin:pydoc, is skipped), when OUT is a symbolic link to
    nothing or (existing) to a folder that is not an output of ours, when OUT exists (without --force), or when
    it cannot be created. Returns the folder the run writes: OUT, or what OUT points to when it is a link."""
    out = Path(out)
    target = write_target(out)
    shown = f"{out} (a link to {target})" if out.is_symlink() else str(out)
    real = target.resolve()
    for what, path in inputs:
        verb = _overlap(real, path)
        if verb:
            raise InputError(f"output {shown} {verb} the input {path} ({what}), which this run reads; --force "
                             "never replaces an input: give another -o")
    if out.is_symlink() and not target.exists():
        raise InputError(f"output {out} is a symbolic link to {target}, which does not exist; remove the link or "
                         "give another -o")
    if out.is_symlink() and not (target.is_dir() and any((target / name).is_file() for name in OUR_FILES)):
        raise InputError(f"output {shown} is not an output of geminicompress (it holds no {OUR_FILES[0]}); --force "
                         "replaces only our own outputs through a link: remove the link or give another -o")
    if target.exists() and not force:
        raise InputError(f"output {out} already exists; pass --force to replace it")
    if target.exists() and not target.is_dir():
        raise InputError(f"output {out} exists and is not a directory")
    if not real.parent.exists():
        raise InputError(f"the parent folder of output {out} does not exist")
    return target


def write_target(out: Path) -> Path:
    """Where a run on OUT writes: what OUT points to when it is a symbolic link (followed to the end), else OUT."""
    if not out.is_symlink():
        return out
    try:
        return out.resolve()
    except (RuntimeError, OSError) as exc:  # a loop of links (RuntimeError before Python 3.13)
        raise InputError(f"output {out} is a symbolic link that cannot be followed ({exc}); remove it or give "
                         "another -o") from None


def _overlap(out_real: Path, path: str | Path | None) -> str:
    """'is' when the input `path` is the folder OUT (resolved) names, 'holds' when it lies under it, else ''. Both
    the path as written (made absolute) and the path it resolves to count: deleting OUT would remove either."""
    if path is None or str(path) == "":
        return ""
    p = Path(path).expanduser()
    try:
        if not (p.exists() or p.is_symlink()):
            return ""  # a hub id, a hub dataset, builtin:pydoc: nothing on this disk to lose
        seen = (Path(os.path.abspath(p)), p.resolve())
    except (OSError, ValueError, RuntimeError):  # a name the OS refuses, a loop of links: not a readable input
        return ""
    if out_real in seen:
        return "is"
    return "holds" if any(out_real in q.parents for q in seen) else ""


def partial_dir(out: Path) -> Path:
    """The hidden sibling `.<name>.partial` that a run on OUT writes into (beside what OUT points to, for a link)."""
    out = write_target(Path(out))
    return out.with_name(f".{out.name}.partial")


def final_name(partial: Path) -> str:
    """`.out.partial` -> `out`: the name the output will have once the run completes."""
    return partial.name.removeprefix(".").removesuffix(".partial")


class OutputDir:
    """`with OutputDir(out, force, fingerprint, inputs) as tmp:` write into `tmp`; renamed to `out` (what `out`
    points to, for a link) on success. `inputs`: what the run reads, (what, path) pairs (check_output_path)."""

    def __init__(self, out: Path | str, force: bool = False, fingerprint: str = "", inputs: Inputs = ()) -> None:
        self.out = Path(out)
        self.force = force
        self.fingerprint = fingerprint
        self.inputs = list(inputs)
        self.tmp = partial_dir(self.out)
        self.state_dir = self.tmp / STATE_DIR

    def __enter__(self) -> Path:
        self.dest = check_output_path(self.out, self.force, self.inputs)
        self.lock = lock_partial(self.tmp)
        try:
            # again: a run that held the lock may have just finished OUT
            self.dest = check_output_path(self.out, self.force, self.inputs)
            stamp = self.state_dir / _FINGERPRINT
            resumable = stamp.is_file() and stamp.read_text() == self.fingerprint and self.fingerprint
            # Anything but state/ (when resumable) from an earlier attempt is stale: the stages write it again.
            for child in self.tmp.iterdir():
                if child.name != LOCK_FILE and (child.name != STATE_DIR or not resumable):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            stamp.write_text(self.fingerprint)
        except BaseException:
            self.lock.close()
            raise
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                shutil.rmtree(self.state_dir, ignore_errors=True)
                apply_umask(self.tmp)
                if self.dest.exists():
                    shutil.rmtree(self.dest)
                self.tmp.rename(self.dest)  # the lock held through the rename: no second run opens it in between
                (self.dest / LOCK_FILE).unlink(missing_ok=True)
                return False
            if not self._has_resume_state() or issubclass(exc_type, InputError):
                shutil.rmtree(self.tmp, ignore_errors=True)  # bad input: the same command would stop there again
            # else: keep the hidden partial folder so that the same command resumes from its state/
            return False
        finally:
            self.lock.close()

    def _has_resume_state(self) -> bool:
        if not self.fingerprint or not self.state_dir.is_dir():
            return False
        return any(p.is_file() and p.name not in (_FINGERPRINT, THREADS_FILE) for p in self.state_dir.rglob("*"))


def lock_partial(tmp: Path):
    """Create the partial folder `tmp` if needed and take the exclusive lock on `tmp/lock`, writing this
    process's pid into it; returns the open lock file (closing it releases the lock). An InputError naming
    the holder when another process has it."""
    final = final_name(tmp)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / LOCK_FILE
        f = open(path, "a+")
    except OSError as exc:
        from geminicompress.host.diskerrors import disk_error
        raise disk_error(exc, f"the partial folder {tmp} of {final}", before=True) from exc
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise InputError(f"another run (pid {holder}) is writing {final} (it holds {path}); wait for it to "
                         "finish, or stop it, then rerun") from None
    try:
        same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the holder finished meanwhile and its folder became OUT: lock the new partial folder
        f.close()
        return lock_partial(tmp)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


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
