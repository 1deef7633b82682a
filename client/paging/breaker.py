"""``CircuitBreaker``: stop asking a dependency that keeps failing.

Used by the vLLM connector's scheduler side around index lookups: after ``failures``
consecutive faults (an error or a lookup past its budget) the breaker opens and every
request is a miss at no cost for ``cooldown`` seconds; then one probe is let through
(half-open). A success closes it; a failed probe opens it again for twice as long, up
to ``max_cooldown``. Single-threaded use (the scheduler loop); the clock is injectable
for tests."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 3,
        cooldown: float = 2.0,
        max_cooldown: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or cooldown <= 0 or max_cooldown < cooldown:
            raise ValueError(
                f"bad breaker settings: failures={failures}, cooldown={cooldown}, max_cooldown={max_cooldown}"
            )
        self.failures = failures
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self._clock = clock
        self._streak = 0
        self._open_until: float | None = None
        self._current_cooldown = cooldown
        self._probing = False
        self.opened = 0  # times the breaker has opened, for metrics

    @property
    def current_cooldown(self) -> float:
        """Seconds the breaker stays open when it opens next (or now)."""
        return self._current_cooldown

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half-open"

    def allow(self) -> bool:
        """Whether a call may be made now (in half-open state: one probe at a time)."""
        if self._open_until is None:
            return True
        if self._clock() < self._open_until or self._probing:
            return False
        self._probing = True
        return True

    def record(self, ok: bool) -> None:
        """The outcome of a call that ``allow`` let through."""
        if ok:
            self._streak = 0
            self._open_until = None
            self._current_cooldown = self.cooldown
            self._probing = False
            return
        self._streak += 1
        if self._probing:  # the probe failed: back off further
            self._current_cooldown = min(self._current_cooldown * 2, self.max_cooldown)
            self._open(self._current_cooldown)
        elif self._open_until is None and self._streak >= self.failures:
            self._open(self._current_cooldown)

    def _open(self, seconds: float) -> None:
        self._open_until = self._clock() + seconds
        self._probing = False
        self.opened += 1
