"""What the worker tells vLLM about loads that failed (a page missing, torn or refused),
so vLLM recomputes instead of reading KV that never arrived.

vLLM 0.32 takes failures two ways. With one KV-cache group, as block ids
(``get_block_ids_with_load_errors``): it recomputes a request from its first failed
block and keeps the blocks before it. With several groups (a hybrid model: sliding
and full layers), block ids are unique only within a group, so vLLM raises on them
("A KV connector reported block-level load failures ... not supported for models with
multiple KV cache groups", ``Scheduler._handle_invalid_blocks``) and stops the engine;
such a failure must come as the request's id in ``get_transfer_results``'
``failed_recving``, and vLLM recomputes the whole request (found with a corrupted
stored page under a tiny Gemma-3: the engine died; tests/vllm/test_vllm_hybrid.py)."""

from __future__ import annotations

import threading

from client.paging.loader import LoadOutcome
from client.vllm.stats import StatsRecorder


class LoadErrors:
    """Failed loads until the engine step takes them. ``record`` is called by the loader
    threads' results on the engine thread, and ``fail`` by ``start_load_kv``; the
    ``take_*`` calls by the engine thread. ``by_request``: the cache has several
    KV-cache groups (known from vLLM's config when the worker is built)."""

    def __init__(self, stats: StatsRecorder, by_request: bool = False) -> None:
        self._stats = stats
        # the engine thread and the layer-wise loads' threads share these (taken before
        # the stats recorder's lock, never after it)
        self._lock = threading.Lock()
        self._blocks: set[int] = set()
        self._requests: set[str] = set()
        self.by_request = by_request

    def fail(self, req_id: str, block_ids: list[int]) -> None:
        """``req_id``'s load could not start: ``block_ids`` (every group's, from its
        first loaded block) are recomputed."""
        with self._lock:
            self._add(req_id, block_ids)

    def record(self, outcome: LoadOutcome, req_id: str | None) -> None:
        """A finished load: its failed blocks and its counts (``req_id`` None: a
        layer-wise load, which runs in the step and reports by block)."""
        with self._lock:
            if outcome.failed:
                self._add(req_id, outcome.failed)
            self._stats.count(load_bytes=outcome.nbytes, load_failed_blocks=len(outcome.failed))
            self._stats.stats.observe("load_seconds", outcome.seconds)

    def _add(self, req_id: str | None, block_ids: list[int]) -> None:
        if self.by_request and req_id is not None:
            self._requests.add(req_id)
        else:
            self._blocks.update(block_ids)

    def take_blocks(self) -> set[int]:
        """Block ids whose loads failed since the last call (one KV-cache group)."""
        with self._lock:
            taken, self._blocks = self._blocks, set()
        return taken

    def take_requests(self) -> set[str]:
        """Requests whose loads failed since the last call (several KV-cache groups)."""
        with self._lock:
            taken, self._requests = self._requests, set()
        return taken
