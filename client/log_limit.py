"""``LogLimit``: a fault that repeats with every request is logged at WARNING the first
time and then at most once per ``every_s`` seconds, saying how many times it happened
since, and at DEBUG otherwise: an engine's log shows that something is wrong and how
often, without a line per request. Counters are kept by the callers (the connector's
``vllm:kvstore_*``, ``ClientStats``); this only decides the level of each line."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

EVERY_S = 60.0


class LogLimit:
    """Per key (a fault's kind, a node), the time of its last WARNING and the repeats
    since. Any thread."""

    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self._log = logger
        self._every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        """``msg % args`` at WARNING when ``key`` was not warned of in the last
        ``every_s`` seconds (with the count of repeats since), else at DEBUG."""
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: Any) -> None:
        """``warning``, at ERROR: a fault that only the operator can mend."""
        self.log(logging.ERROR, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: Any) -> None:
        """``msg % args`` at ``level``, or at DEBUG when ``key`` was logged at its level
        in the last ``every_s`` seconds."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._every_s:
                self._since[key] = self._since.get(key, 0) + 1
                loud = False
            else:
                self._last[key] = now
                repeats = self._since.pop(key, 0)
                loud = True
        if not loud:
            self._log.debug(msg, *args)
            return
        if repeats:
            msg += (
                f" ({repeats} more since the last such line; next at most in {self._every_s:.0f} s)"
            )
        elif last is None:
            msg += f" (repeats are logged at most once every {self._every_s:.0f} s)"
        self._log.log(level, msg, *args)
