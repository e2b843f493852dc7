"""Run a command and write its own peak resident memory (KiB) to a file: `peak_rss.py FILE -- CMD...`.

Why a separate process: on Linux a child started from a big process (Python's subprocess uses vfork,
then exec) inherits that process's peak RSS into its `ru_maxrss`, because exec folds the old address
space's high-water mark into the child's. Measured here: `/bin/true` started from a Python process that
had touched 1.5 GB reported 1.41 GiB. This trampoline is small, so the command it starts reports only
its own peak. Exits with the command's exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    out, sep, *cmd = sys.argv[1:]
    if sep != "--" or not cmd:
        raise SystemExit("usage: peak_rss.py FILE -- CMD...")
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    with open(out, "w") as f:
        f.write(str(usage.ru_maxrss))
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
