"""A worker's wait for prefixes another engine announced it is saving (a P/D handoff:
``client.vllm.transfer_params``), on one thread of its own, so neither the engine step
nor the loader threads wait.

Called by ``client.vllm.worker.ConnectorWorker.start_load_kv`` for each
``AwaitedLoad``: ``PrefixWaiter.add`` returns a future at once. The thread asks the
index for the prefix (``find``), again after 2 ms, doubling to at most
``POLL_MAX_S``, until every announced block is stored or the load's ``wait_s`` has
passed; then it hands what was found to ``start`` (the worker's loader) and the future
ends with that load's outcome. Past the deadline the blocks not stored are recomputed:
never a hang, never a block loaded that the index did not name.

Why polling, measured: a prefill's save is usually stored a few ms to a few hundred ms
after the decode's request arrives, so a wait takes a handful of lookups (each about
0.3 ms of the index's and this thread's time) and ends at most ``POLL_MAX_S`` after
the pages were committed. A ticket the prefill's saver pushes through the index
(BLPOP) would end it sooner, at the price of index ACL rules and a key per handoff."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from client.lookups.stored_prefix import StoredPrefix
from client.paging.loader import LoadOutcome
from client.paging.specs import AwaitedLoad
from kvstore.pages.identity import BlockExtras

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
# One lookup's own limit: a slow index costs a poll, never the whole wait at once.
FIND_TIMEOUT_S = 0.5


@dataclass
class Waited:
    """How one wait ended, for the worker's counters: the blocks announced and found,
    the seconds waited and the lookups made."""

    announced: int
    found: int
    seconds: float
    lookups: int

    @property
    def in_time(self) -> bool:
        return self.found >= self.announced


@dataclass
class _Waiting:
    load: AwaitedLoad
    future: Future[LoadOutcome]
    started: float
    deadline: float
    next_at: float
    interval: float = POLL_FIRST_S
    lookups: int = 0
    found: StoredPrefix | None = field(default=None)


class PrefixWaiter:
    """``find(tokens, extras, timeout)``: the stored prefix (None on an index fault);
    ``start(load, found, waited)``: the worker's load of what ``found`` holds (None:
    nothing), a future of its outcome. Thread-safe; ``close`` ends every wait at once,
    as if past its deadline."""

    def __init__(
        self,
        find: Callable[[list[int], BlockExtras, float], StoredPrefix | None],
        start: Callable[[AwaitedLoad, StoredPrefix | None, Waited], Future[LoadOutcome]],
    ) -> None:
        self._find = find
        self._start = start
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: list[_Waiting] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, load: AwaitedLoad) -> Future[LoadOutcome]:
        """Wait for ``load``'s prefix (its deadline counts from now); the future ends
        with its load's outcome."""
        now = time.monotonic()
        waiting = _Waiting(load, Future(), now, now + load.wait_s, now)
        with self._lock:
            if self._closed:
                raise RuntimeError("the prefix waiter is closed")
            self._waiting.append(waiting)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-prefix-waiter", daemon=True
                )
                self._thread.start()
        self._wake.set()
        return waiting.future

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=FIND_TIMEOUT_S + 1)

    def _run(self) -> None:
        while True:
            with self._lock:
                closed, waiting = self._closed, list(self._waiting)
            if closed:
                for w in waiting:
                    self._end(w)
                return
            now = time.monotonic()
            for w in waiting:
                if w.next_at <= now:
                    self._poll(w)
            with self._lock:
                soonest = min((w.next_at for w in self._waiting), default=None)
            self._wake.wait(None if soonest is None else max(soonest - time.monotonic(), 0))
            self._wake.clear()

    def _poll(self, w: _Waiting) -> None:
        """Ask the index once; end the wait when the prefix is whole or time is up."""
        left = w.deadline - time.monotonic()
        if left > 0:
            w.lookups += 1
            try:
                found = self._find(w.load.tokens, w.load.extras, min(FIND_TIMEOUT_S, left))
            except Exception:  # a fault is a miss; the next poll asks again
                log.debug("announced prefix of %s: lookup failed", w.load.req_id, exc_info=True)
                found = None
            if found is not None:
                w.found = found
            if found is None or found.blocks < len(w.load.block_ids):
                now = time.monotonic()
                if now < w.deadline:
                    w.next_at = min(now + w.interval, w.deadline)
                    w.interval = min(w.interval * 2, POLL_MAX_S)
                    return
        self._end(w)

    def _end(self, w: _Waiting) -> None:
        """Hand ``w`` to the loader with what was found, and chain its outcome."""
        with self._lock:
            if w in self._waiting:
                self._waiting.remove(w)
        found = w.found
        waited = Waited(
            len(w.load.block_ids),
            min(found.blocks, len(w.load.block_ids)) if found is not None else 0,
            time.monotonic() - w.started,
            w.lookups,
        )
        try:
            started = self._start(w.load, found, waited)
        except BaseException as exc:  # the future must end: the engine waits for it
            w.future.set_exception(exc)
            return
        started.add_done_callback(lambda f: _chain(f, w.future))


def _chain(source: Future[LoadOutcome], target: Future[LoadOutcome]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
