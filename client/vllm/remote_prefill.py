"""The decode worker's side of a P/D handoff: loads of prefixes a prefill engine
announced (``client.vllm.transfer_params``), waited for on the ``PrefixWaiter``'s
thread, then loaded by the worker's loader threads as any hit, and counted.

Built by ``ConnectorWorker.register_kv_caches``; ``add`` is called from
``start_load_kv`` and its future is reported by ``get_finished`` like a load's."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any

from client.lookups.stored_prefix import StoredPrefix
from client.paging.awaiting import PrefixWaiter, Waited
from client.paging.loader import LoadOutcome, PageLoader
from client.paging.specs import AwaitedLoad
from client.vllm.stats import StatsRecorder
from client.vllm.store import PageStore
from kvstore.pages.identity import BlockExtras


class RemotePrefills:
    """``counts``: this worker counts the handoff's prefixes (the first rank only, so a
    TP engine counts each request once; every rank waits and loads its own share)."""

    def __init__(
        self,
        client: PageStore,
        loader: Executor,
        pages: PageLoader,
        stats: StatsRecorder,
        *,
        block_size: int,
        counts: bool,
    ) -> None:
        self._client = client
        self._loader = loader
        self._pages = pages
        self._stats = stats
        self._block_size = block_size
        self._counts = counts
        self._waiter = PrefixWaiter(self._find, self._start)
        # per request, the event its blocks' earlier work on the compute stream ends
        # with (CUDA; None on the CPU), waited for by the load's copies as any load's
        self._after: dict[str, Any] = {}

    def add(self, load: AwaitedLoad, after: Any) -> Future[LoadOutcome]:
        self._after[load.req_id] = after
        return self._waiter.add(load)

    def close(self) -> None:
        self._waiter.close()

    def _find(self, tokens: list[int], extras: BlockExtras, timeout: float) -> StoredPrefix | None:
        return self._client.find(tokens, timeout=timeout, identity=extras or None)

    def _start(
        self, load: AwaitedLoad, found: StoredPrefix | None, waited: Waited
    ) -> Future[LoadOutcome]:
        """Load what ``found`` holds of ``load``; the blocks past it fail (recomputed)."""
        after = self._after.pop(load.req_id, None)
        self._stats.count(remote_prefill_lookups=waited.lookups)
        self._stats.observe("remote_prefill_wait_seconds", waited.seconds)
        # waited.found: the blocks of it stored (0 when the index never answered)
        rest = load.ids_from(waited.found)
        if self._counts:
            missing = len(load.block_ids) - max(waited.found, load.start_block)
            self._stats.count(
                remote_prefills_in_time=int(waited.in_time),
                remote_prefill_deadline_misses=int(not waited.in_time),
                remote_prefill_recomputed_tokens=missing * self._block_size,
            )
        if found is None or waited.found <= load.start_block:
            done: Future[LoadOutcome] = Future()
            done.set_result(LoadOutcome(rest, 0, waited.seconds))
            return done
        spec = load.load(found)

        def run() -> LoadOutcome:
            outcome = self._pages.load(spec, after)
            return LoadOutcome(outcome.failed + rest, outcome.nbytes, outcome.seconds)

        return self._loader.submit(run)
