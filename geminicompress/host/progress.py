"""Progress reporting without printing: library code calls a `Progress`, the CLI draws it.

Library code never prints (STYLE.md rule 8). Long loops take a `Progress` and call
`task(...)` / `advance(...)`; the CLI passes a rich-backed one, tests pass `NullProgress`.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator, Protocol

log = logging.getLogger("geminicompress")


class Task(Protocol):
    def advance(self, n: int = 1, **fields: object) -> None: ...


class Progress(Protocol):
    def task(self, description: str, total: int | None) -> AbstractContextManager[Task]: ...

    def info(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...


class _NullTask:
    def advance(self, n: int = 1, **fields: object) -> None:
        return None


class NullProgress:
    """Progress that logs messages and draws nothing (tests, library use)."""

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Task]:
        yield _NullTask()

    def info(self, message: str) -> None:
        log.info(message)

    def warn(self, message: str) -> None:
        log.warning(message)
