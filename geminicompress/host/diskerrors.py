"""The user's machine refusing a write (a full disk, a quota, a read-only filesystem, no permission) is not our
bug: each is one line that says what was being written, what the disk has, and what to do.

`disk_errno(exc)` recognises such a failure: an `OSError` with one of `DISK_ERRNOS`, or the safetensors
library's own error, which wraps the OS error in its message ("No space left on device (os error 28)").
`disk_error(exc, what, ...)` is the project error for it: an `InputError` (exit 2) when found before the work
(the output's folder cannot be created), else a `DiskError` (exit 1) that says the partial run's fate.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from geminicompress.core.errors import GeminiError, InputError

DISK_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class DiskError(GeminiError):
    """A write to OUT failed during the work because of the disk (exit 1)."""


def disk_errno(exc: BaseException) -> int | None:
    """The errno of a disk refusal (one of DISK_ERRNOS) behind `exc`, its causes included; None for anything else."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc.errno
        if type(exc).__name__ == "SafetensorError":  # safetensors' Rust side: "... (os error 28)"
            found = _OS_ERROR.search(str(exc))
            if found and int(found.group(1)) in DISK_ERRNOS:
                return int(found.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None when unknown."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tree_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk (0 when it is gone)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue
    return total


def size_text(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def _what_of(exc: BaseException | None, what: str) -> str:
    """The file the refused write was to: the first `filename` in `exc`'s chain, else `what`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "filename", None):
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return what


def disk_error(exc: BaseException, what: str, *, before: bool = False, partial: Path | None = None) -> GeminiError:
    """The one-line project error for a disk refusal `exc` (disk_errno(exc) must not be None) while writing
    `what`. before: found before any work (exit 2). partial: the run's partial folder, whose fate is said."""
    code = disk_errno(exc)
    reason = DISK_ERRNOS.get(code, "the disk refused the write")
    where = _what_of(exc, what)
    free = free_bytes(partial if partial is not None else Path(where))
    full = code in (errno.ENOSPC, errno.EDQUOT)
    fix = ("free some space or choose another output folder" if full else
        "choose an output folder you can write to, or fix its permissions")
    if before:
        return InputError(f"cannot write {where}: {reason} ({size_text(free)} free there); {fix}; nothing was written")
    fate = ""
    if partial is not None:
        if partial.exists():
            then = "free some space" if full else "make it writable"
            fate = (f"; the partial run {partial} ({size_text(tree_bytes(partial))}) is kept: {then} and rerun the "
                    f"same command to resume it, or delete it to give its space back")
        else:
            fate = f"; nothing was kept ({partial} was removed)"
    return DiskError(f"{reason} while writing {where} ({size_text(free)} free there){fate}")
