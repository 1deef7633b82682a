"""A table read from a file and re-read when the file changes, for the credential
files a node serves from (data-plane tokens, event-stream router keys).

Kubernetes swaps a mounted Secret's file when the Secret changes; the node picks the
new table up within ``recheck`` seconds, so credentials rotate without a restart."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from kvstore.errors import InvalidInputError

log = logging.getLogger(__name__)
T = TypeVar("T")


class WatchedTable(Generic[T]):
    """``parse(text, path)`` of the file at ``path``, re-read when its inode, size or
    mtime changed (checked at most once per ``recheck`` seconds, from any thread).

    The first load must succeed (``InvalidInputError`` naming the file). A file that
    later turns unreadable or malformed keeps the last good table and logs an error on
    each check (counted in ``reload_errors``), so a bad edit neither locks everyone
    out nor lets anyone in."""

    def __init__(
        self,
        path: str,
        parse: Callable[[str, str], dict[str, T]],
        what: str,
        *,
        recheck: float = 1.0,
    ) -> None:
        self.path = path
        self.what = what  # "credentials", "router keys": names the file in errors and logs
        self.recheck = recheck
        self._parse = parse
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = time.monotonic()
        self._table: dict[str, T] = {}
        self.reloads = 0
        self.reload_errors = 0
        self._load(initial=True)

    def table(self, *, fresh: bool = False) -> dict[str, T]:
        """The current table (re-read first when the file changed). Callers must not
        modify it: a reload replaces it whole. ``fresh``: look at the file now, not at
        most once per ``recheck`` (for rare questions a stale answer would get wrong
        for good, such as a handshake a client does not retry)."""
        now = time.monotonic()
        if fresh or now - self._checked >= self.recheck:
            with self._lock:
                if fresh or now - self._checked >= self.recheck:
                    self._load()
                    self._checked = now
        return self._table

    def _load(self, initial: bool = False) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path) as f:
                table = self._parse(f.read(), self.path)
        except (OSError, InvalidInputError) as exc:
            message = exc.strerror if isinstance(exc, OSError) else str(exc)
            if initial:
                raise InvalidInputError(
                    f"cannot load {self.what} file {self.path}: {message}"
                ) from None
            self.reload_errors += 1
            log.error(
                "%s file %s not reloaded, keeping the %d entries loaded before: %s",
                self.what,
                self.path,
                len(self._table),
                message,
            )
            return
        self._table = table
        self._stamp = stamp
        if not initial:
            self.reloads += 1
            log.info("%s file %s reloaded: %d entries", self.what, self.path, len(table))
