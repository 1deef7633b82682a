"""The worker's saves after the engine step copied their pages out: the bound on bytes
waiting to be published (``max_pending_save_bytes``; past it a save is dropped and
counted, never waited for), the one saver thread that publishes them, and each save's
outcome for the scheduler's KV events (``client.vllm.events``).

Used by ``client.vllm.worker.ConnectorWorker``: ``reserve`` and ``submit`` on the engine
thread, ``release`` on either thread, ``publish`` on the saver thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from client.log_limit import LogLimit
from client.paging.paged_cache import GatherResult
from client.paging.specs import SaveSpec
from client.paging.staging_pool import StagingPool
from client.vllm.events import SaveOutcomeLog, SaveOutcomes
from client.vllm.stats import StatsRecorder
from client.vllm.store import PageStore
from kvstore.errors import CredentialError

log = logging.getLogger(__name__)
# a fault fails every save: a WARNING at most once a minute, the others at DEBUG
_LIMIT = LogLimit(log)


class SaveQueue:
    """Saves copied out of the cache and not yet published: their bytes (bounded), the
    saver thread publishing them and the outcomes of the finished ones."""

    def __init__(
        self,
        max_pending_bytes: int,
        stats: StatsRecorder,
        credential_refused: Callable[[CredentialError], None],
    ) -> None:
        self._max_pending_bytes = max_pending_bytes
        self._stats = stats
        self._credential_refused = credential_refused
        self._lock = threading.Lock()  # the pending bytes: engine and saver threads
        self._pending_bytes = 0
        self._saver: ThreadPoolExecutor | None = None  # started once the cache is registered
        self.in_flight: set[Future] = set()  # get_finished waits on these when idle
        self.outcomes = SaveOutcomeLog()

    def start(self) -> None:
        """Called once the worker's cache is registered: saves may be submitted."""
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")

    @property
    def started(self) -> bool:
        return self._saver is not None

    def reserve(self, req_id: str, nbytes: int) -> bool:
        """Engine thread: count ``nbytes`` of ``req_id``'s pages as pending; False (the
        save is dropped, counted and logged) when that would pass the bound."""
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                pending = self._pending_bytes
            else:
                self._pending_bytes += nbytes
                return True
        self._stats.count(saves_dropped=1)
        log.warning("save of %s dropped: %d bytes already wait to be published", req_id, pending)
        return False

    def release(self, nbytes: int) -> None:
        """Pages reserved for that will not be published any more (published, failed or
        dropped)."""
        with self._lock:
            self._pending_bytes -= nbytes

    def submit(
        self,
        client: PageStore,
        staging: StagingPool | None,
        spec: SaveSpec,
        gathered: GatherResult,
        nbytes: int,
        *,
        answers_event: bool = True,
    ) -> None:
        """Engine thread: hand one request's reserved pages to the saver thread
        (``publish``), tracked in ``in_flight`` until published. ``staging``: the pool
        the pages go back to (None: pages of their own, a boundary state's)."""
        assert self._saver is not None, "submit before start"
        future = self._saver.submit(
            self.publish, client, staging, spec, gathered, nbytes, answers_event
        )
        self.in_flight.add(future)
        future.add_done_callback(self.in_flight.discard)

    def publish(
        self,
        client: PageStore,
        staging: StagingPool | None,
        spec: SaveSpec,
        gathered: GatherResult,
        nbytes: int,
        answers_event: bool = True,
    ) -> None:
        """Saver thread: publish one request's pages through ``client`` and give them
        back to ``staging``; failures are counted, not raised. ``answers_event``: the
        outcome answers the save's KV event (the target's pages do; a draft's do not)."""
        started = time.perf_counter()
        stored = False
        try:
            report = client.put_pages(
                spec.token_ids,
                gathered.wait(),
                identity=spec.extras or None,
                start_block=spec.start_block,
            )
            stored = report.refused == 0  # every page of this rank's part on some node
            self._stats.count(save_bytes=report.bytes_sent, save_failures=0 if stored else 1)
            if stored:
                log.debug("saved %s: %s", spec.req_id, report)
            else:  # no live node, every node failing or refusing: a future miss
                _LIMIT.warning(
                    "not stored",
                    "save of %s not stored: %d of %d pages reached no node (a future miss)",
                    spec.req_id,
                    report.refused,
                    report.refused + report.stored,
                )
        except CredentialError as exc:
            self._stats.count(save_failures=1)
            self._credential_refused(exc)
        except Exception as exc:
            self._stats.count(save_failures=1)
            _LIMIT.warning(
                "failed", "save of %s failed (a future miss, not an error): %s", spec.req_id, exc
            )
        finally:
            if staging is not None:
                staging.give_pages(gathered.pages)
            self._stats.observe("save_seconds", time.perf_counter() - started)
            self.release(nbytes)
            if answers_event:
                self.outcomes.report([spec], ok=stored)

    def take_outcomes(self) -> SaveOutcomes | None:
        """Outcomes of saves finished since the engine step last asked (its KV events)."""
        return self.outcomes.take_outcomes()

    def shutdown(self) -> None:
        """Finish the saves in flight (each is bounded by the client's timeout), then stop."""
        if self.in_flight:
            wait_futures(list(self.in_flight))
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        self._saver = None
