"""A hybrid engine's pages copied out step by step (``GatherSpec``: several KV-cache
groups, whose sliding blocks vLLM frees once they leave the window), held in host
memory until the request's save publishes them or it is dropped. Their bytes count
against ``max_pending_save_bytes`` from the first gather on. Used by
``client.vllm.worker.ConnectorWorker`` on the engine thread, once its caches are
registered."""

from __future__ import annotations

import logging
import time

from client.paging.loader import layer_rows
from client.paging.paged_cache import GatherResult, PagedCache
from client.paging.specs import GatherSpec
from client.paging.staging_pool import StagingPool
from client.vllm.saver import SaveQueue
from client.vllm.stats import StatsRecorder

log = logging.getLogger(__name__)


class GatheredPages:
    """Each request's gathered pages so far (``layer_groups``: each cache layer's group
    among the page groups, as ``client.vllm.cache_checks.layer_groups_of`` gives)."""

    def __init__(
        self,
        cache: PagedCache,
        staging: StagingPool,
        page_nbytes: int,
        layer_groups: list[int],
        saves: SaveQueue,
        stats: StatsRecorder,
    ) -> None:
        self._cache = cache
        self._staging = staging
        self._page_nbytes = page_nbytes
        self._layer_groups = layer_groups
        self._saves = saves
        self._stats = stats
        self._held: dict[str, GatherResult] = {}

    def gather(self, spec: GatherSpec) -> None:
        """Copy the request's blocks that became full this step into its pages; past
        the pending bytes' bound, or after an earlier gather was dropped (the pages
        would have a hole), the request is not saved. A copy that fails drops the
        request's pages (a future miss, never an engine error)."""
        try:
            self._gather(spec)
        except Exception as exc:
            log.warning("pages of %s not copied out, so it is not saved: %s", spec.req_id, exc)
            self.drop(spec.req_id)

    def _gather(self, spec: GatherSpec) -> None:
        held = self._held.get(spec.req_id)
        pages = spec.blocks - spec.base  # the save's pages: blocks base to blocks - 1
        if held is None:
            if spec.first > spec.base:
                return
            if not self._saves.reserve(spec.req_id, pages * self._page_nbytes):
                return
            held = GatherResult(self._staging.take_pages(pages))
            self._held[spec.req_id] = held
        started = time.perf_counter()
        count = len(spec.group_block_ids[0])
        rows = [
            ([spec.first - spec.base + r for r in positions], blocks)
            for positions, blocks in layer_rows(self._layer_groups, spec.group_block_ids, 0, count)
        ]
        ready = self._cache.gather_layers(rows, held.pages[:pages]).ready
        self._held[spec.req_id] = GatherResult(held.pages[:pages], ready or held.ready)
        self._stats.observe("save_gather_seconds", time.perf_counter() - started)

    def take(self, req_id: str) -> GatherResult | None:
        """The request's pages for its save (None when a gather was dropped); the save
        gives them back once published."""
        return self._held.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        """Give back a request's pages that will not be published, and their bytes from
        the pending saves' count."""
        held = self._held.pop(req_id, None)
        if held is not None:
            pages = held.wait()  # no copy may still land in pages given back
            self._staging.give_pages(pages)
            self._saves.release(len(pages) * self._page_nbytes)
