"""The worker side of the connector: loads into the paged KV cache and saves out of it,
on threads of their own, so nothing blocks the engine step for a transfer.

- Loads: ``start_load_kv`` submits each load to loader threads (the load path itself
  is ``client.paging.loader``; the registered caches are sorted and checked by
  ``client.vllm.cache_checks``), which fetch the pages the scheduler's lookup found
  (a get's plan, ``client.gets.plan``: no second index round trip while that lookup's
  read lease is less than half gone), verified by checksum, and scatter them into the
  paged cache (``PagedCache``: per-layer strided copies in contiguous runs). On a GPU
  the pages land in device memory straight from a same-host node's memory and are
  checked there (``device_plan``), then scattered on a side stream.
  ``get_finished`` reports finished loads; blocks that did not arrive are reported
  through ``get_block_ids_with_load_errors`` no later than that (by request on a
  hybrid cache: ``client.vllm.load_errors``), and vLLM recomputes
  them. Every worker reports every load it was given, so with several TP workers
  vLLM's ``KVOutputAggregator`` sees a request finished only once all have. Layer-wise
  loads (``LoadSpec.layerwise``) run in the step's forward instead
  (``client.paging.layerwise``): ``wait_for_layer_load`` feeds each layer.
- Saves: ``wait_for_save`` copies the blocks out of the cache at the end of the step
  (``client.vllm.save_copies``; on a GPU into a device scratch on the compute stream, so
  later steps may reuse the blocks, and from it to the host on a stream of its own, left
  in flight) and publishes them on a saver thread (``client.vllm.saver``).
  Pending saves are bounded by ``max_pending_save_bytes``; past it a save is dropped
  (counted), never waited for; a saved prompt's pin follows its saves (``client.vllm.pins``).

Every store the worker touches is a ``client.vllm.store.PageStore``, opened through
``client.vllm.worker_setup.WorkerStores`` (a ``KVCacheClient`` each, or a test's
in-memory store), and what it does on this engine is one ``WorkerFeatures``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import torch

from client.paging.layerwise import LayerwiseLoads
from client.paging.loader import LoadOutcome, PageLoader, ids_from
from client.paging.paged_cache import PagedCache
from client.paging.staging_pool import StagingPool
from client.vllm.cache_checks import worker_caches
from client.vllm.drafts import DraftPages
from client.vllm.events import SaveOutcomes
from client.vllm.gathered import GatheredPages
from client.vllm.load_errors import LoadErrors
from client.vllm.metadata import KVStoreConnectorMetadata, LoadSpec
from client.vllm.options import ConnectorOptions
from client.vllm.pins import PinQueue
from client.vllm.remote_prefill import RemotePrefills
from client.vllm.save_copies import copy_out_saves
from client.vllm.saver import SaveQueue
from client.vllm.state_pages import StatePages
from client.vllm.stats import DeviceCounts, RefusalLog, StatsRecorder
from client.vllm.store import PageStore
from client.vllm.support import hybrid_groups, vllm_ranks
from client.vllm.worker_setup import WorkerFeatures, WorkerStores
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
# Longest an idle engine step waits in get_finished for a load to finish: short enough
# that a request arriving meanwhile is scheduled without a noticeable delay.
_IDLE_WAIT_S = 0.02


class ConnectorWorker:
    """Worker-side state: the paged cache, its store, loader and saver threads, the
    staging pool, loads in flight and blocks that failed to load. Until
    ``register_kv_caches`` succeeds the worker cannot load: each load it is given is
    reported finished with every block failed (recomputed). Built by
    ``KVStoreConnector`` for a worker's role (or a test): ``stores`` opens its stores
    once its caches are registered, ``features`` says what it does."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        conf: ConnectorOptions,
        *,
        stats: StatsRecorder,
        stores: WorkerStores,
        features: WorkerFeatures,
        kv_cache_config: KVCacheConfig | None = None,
        ranks: Callable[[], tuple[int, int]] = vllm_ranks,
    ) -> None:
        self._stores = stores
        # A state-space hybrid's groups (client.vllm.states) and, once registered, its
        # state layers' caches and store.
        self._state_facts = features.states
        self._states: StatePages | None = None
        self._vllm_config = vllm_config
        self._ranks = ranks  # (PP rank, TP rank), asked in register_kv_caches
        self._drafts = features.drafts  # the draft's layers, stored apart (client.vllm.drafts)
        self._draft: DraftPages | None = None
        self._kv_cache_config = kv_cache_config
        # Hybrid KV-cache groups (client.vllm.support.hybrid_groups): the group of each
        # layer of the cache, in its order; empty for one group.
        self._layer_groups: list[int] = []
        self._gathered: GatheredPages | None = None  # hybrid: pages gathered step by step
        self._enabled = features.enabled  # False: never loads or saves (client.vllm.support)
        self._conf = conf
        self._stats = stats
        # by block, or by request on a cache of several groups (vLLM stops the engine on a
        # block-level report there), set now: loads fail even when registration does not
        self._load_errors = LoadErrors(stats, by_request=hybrid_groups(kv_cache_config))
        self._refusals = RefusalLog(stats)
        self._block_size = vllm_config.cache_config.block_size
        self._client: PageStore | None = None
        self._cache: PagedCache | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future] = {}
        self._unloadable: set[str] = set()  # loads given to a worker that cannot load
        # saves copied out and not yet published, and their outcomes for the scheduler's
        # KV events (client.vllm.events)
        self._saves = SaveQueue(conf.max_pending_save_bytes, stats, self._refusals.refused)
        self._pins = PinQueue(stats)
        self._load_stream: Any = None
        self._staging: StagingPool | None = None
        self._page_loader: PageLoader | None = None  # set once register_kv_caches succeeds
        self._remote: RemotePrefills | None = None  # likewise: P/D loads waited for
        self._layerwise: LayerwiseLoads | None = None  # likewise
        self._devices = DeviceCounts(stats)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self._enabled:
            return
        facts = self._state_facts
        draft_names = self._drafts.layers if self._drafts is not None else []
        pp_rank, tp_rank = self._ranks()
        try:
            caches = worker_caches(
                self._vllm_config,
                kv_caches,
                self._block_size,
                pp_rank,
                self._kv_cache_config,
                draft_names,
                facts,
            )
        except KVStoreError as exc:
            log.error("KVStoreConnector disabled on this worker: %s", exc)
            self._cache = None
            return
        names, layout, draft_cache = caches.names, caches.layout, caches.draft
        self._cache, self._layer_groups = caches.cache, caches.layer_groups
        self._client = self._stores.engine(
            layout=layout,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            page_layers=len(names) if facts is not None else None,
        )
        if facts is not None and self._kv_cache_config is not None:
            try:
                self._states = StatePages.for_worker(
                    facts,
                    self._kv_cache_config,
                    kv_caches,
                    lambda: self._stores.states(facts, tp_rank=tp_rank),
                )
            except KVStoreError as exc:
                log.error("KVStoreConnector disabled on this worker: %s", exc)
                self._cache = None
                return
        buffers = self._conf.load_threads + 1  # every load at once, and one save
        pages = self._conf.staging_bytes // buffers // self._client.namespace.page_nbytes
        self._staging = StagingPool(self._cache, buffers, pages)
        self._gathered = GatheredPages(
            self._cache,
            self._staging,
            self._client.namespace.page_nbytes,
            self._layer_groups,
            self._saves,
            self._stats,
        )
        self._cache.warm()  # a GPU's save kernel compiles here, not in the first save's step
        self._loader = ThreadPoolExecutor(
            self._conf.load_threads, thread_name_prefix="kvstore-load"
        )
        self._saves.start()
        if self._cache.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=self._cache.device)
        self._page_loader = PageLoader(
            self._client,
            self._cache,
            self._staging,
            block_size=self._block_size,
            layer_groups=self._layer_groups,
            load_stream=self._load_stream,
            credential_refused=self._refusals.refused,
        )
        self._remote = RemotePrefills(
            self._client,
            self._loader,
            self._page_loader,
            self._stats,
            block_size=self._block_size,
            counts=(pp_rank, tp_rank) == (0, 0),
        )
        self._layerwise = LayerwiseLoads(
            self._page_loader,
            self._cache,
            self._loader,
            self._load,
            feeds=draft_cache is None,  # a draft's pages land whole, beside the target's
            timeout=self._client.call_limit,
            layer_index={name: i for i, name in enumerate(names)},
        )
        if draft_cache is not None and self._drafts is not None:
            client = self._stores.draft(self._drafts, layout=caches.draft_layout, tp_rank=tp_rank)
            # as many pages per buffer as the target's: every load and save moves both
            self._draft = DraftPages.build(
                client, draft_cache, self._page_loader, buffers=buffers, pages=pages
            )

    # ---- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not (meta.loads or meta.awaited):
            return
        after = None
        if self._load_stream is not None:  # blocks were freed by earlier work on the compute stream
            after = torch.cuda.Event()
            after.record()
        for awaited in meta.awaited:
            if self._remote is None:
                self._load_errors.fail(awaited.req_id, awaited.ids_from(awaited.start_block))
                self._unloadable.add(awaited.req_id)
            else:
                self._loading[awaited.req_id] = self._remote.add(awaited, after)
        for spec in meta.loads:
            if self._page_loader is None or self._loader is None:
                self._load_errors.fail(spec.req_id, ids_from(spec, spec.start_block))
                self._unloadable.add(spec.req_id)
                continue
            if spec.layerwise and self._layerwise is not None:
                self._layerwise.start(spec, after)  # this step's forward waits for it
                continue
            self._loading[spec.req_id] = self._loader.submit(self._load, spec, after)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Engine thread, before the layer reads the cache: its part of this step's
        layer-wise loads (``client.paging.layerwise``)."""
        if self._layerwise is not None:
            self._layerwise.wait_layer(layer_name)

    def _load(self, spec: LoadSpec, after: Any) -> LoadOutcome:
        """Loader thread: the target's blocks, then the draft's of the same blocks when the
        engine stores a draft's; a block either failed is recomputed for both."""
        assert self._page_loader is not None  # start_load_kv submits only once registered
        outcome = self._page_loader.load(spec, after)
        if self._states is not None:
            return self._states.load_after(spec, outcome, self._refusals.refused)
        if self._draft is None:
            return outcome
        return self._draft.load_after(spec, outcome, after)

    def _registered(self) -> tuple[PageStore, PagedCache, StagingPool]:
        """The client, paged cache and staging pool of a worker whose
        ``register_kv_caches`` succeeded; raises ``KVStoreError`` on any other (its
        callers end that as a failed load or an unsaved request)."""
        if self._client is None or self._cache is None or self._staging is None:
            raise KVStoreError("this worker has no registered KV cache")
        return self._client, self._cache, self._staging

    def get_finished(self, meta: Any) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (``meta``: this step's metadata, None
        when the step carried none)."""
        if (
            (self._loading or self._saves.in_flight)
            and isinstance(meta, KVStoreConnectorMetadata)
            and meta.idle
        ):
            # The engine has nothing to compute and would call again at once: wait for
            # a load here instead, with the GIL released. Without this the in-process
            # engine loop spins and starves the loader and transfer threads: measured
            # in bench/vllm_ttft.py, a 120 MiB load took 4.6 s, and 0.41 s with the wait.
            # Saves too: an engine keeps stepping idle while a save's KV event waits for it.
            wait_futures(
                [*self._loading.values(), *self._saves.in_flight],
                timeout=_IDLE_WAIT_S,
                return_when=FIRST_COMPLETED,
            )
        done, self._unloadable = self._unloadable, set()
        for req_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            self._load_errors.record(future.result(), req_id)
            done.add(req_id)
        draft = self._draft.client if self._draft is not None else None
        self._devices.report([c.stats for c in (self._client, draft) if c is not None])
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine thread, after the forward: this step's layer-wise loads end here."""
        for _, outcome in self._layerwise.finish() if self._layerwise is not None else []:
            self._load_errors.record(outcome, None)
        return self._load_errors.take_blocks()

    def take_failed_loads(self) -> set[str]:
        """Engine thread: requests whose loads failed, on a cache of several KV-cache
        groups (``client.vllm.load_errors``), reported as vLLM's ``failed_recving``."""
        return self._load_errors.take_requests()

    # ---- saves ---------------------------------------------------------------------

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        for req_id in meta.dropped:
            if self._gathered is not None:
                self._gathered.drop(req_id)
        # Nothing to save here when this worker cannot (its saves' events are withheld),
        # or another rank holds the same replicated heads (MLA's latent) and saves them.
        if not self._saves.started:
            self._saves.outcomes.report(meta.saves, ok=False)
            return
        client, cache, staging = self._registered()  # saves start once registered
        # a rank may hold a state share of its own while another rank writes the
        # attention heads it holds (TP above the KV heads): states first
        for state in meta.states:
            if self._states is not None:
                self._states.save(state, self._saves, self._block_size)
        heads = client.namespace.stores_heads
        if not heads:
            self._saves.outcomes.report(meta.saves, ok=True)
        else:
            copy_out_saves(
                meta,
                client,
                cache,
                staging,
                self._saves,
                self._stats,
                gathered=self._gathered,
                draft=self._draft,
            )
        # each pin through the clients this rank saved with, once those saves are published
        pinners = [client, *([self._draft.client] if self._draft else [])] if heads else []
        states = [self._states.client] if self._states is not None else []
        self._pins.after(meta.pins, self._saves.in_flight, pinners + states)

    def take_save_outcomes(self) -> SaveOutcomes | None:
        """Outcomes of saves finished since the engine step last asked (its KV events)."""
        return self._saves.take_outcomes()

    def shutdown(self) -> None:
        """Finish the saves in flight (each is bounded by the client's timeout), then stop."""
        log.info("shutting down: %d save(s) in flight finish first", len(self._saves.in_flight))
        started = time.monotonic()
        self._saves.shutdown()
        self._pins.shutdown()  # the pins of those saves, before the clients close
        saved = time.monotonic()
        if self._remote is not None:  # waits end now: their loads fail, recomputed
            self._remote.close()
            self._remote = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        self._loader = None
        states = self._states.client if self._states is not None else None
        for client in (
            self._client,
            self._draft.client if self._draft is not None else None,
            states,
        ):
            if client is not None:
                client.close()
        self._client = self._draft = self._states = None
        # vLLM gives workers 5 s after SIGTERM before it kills them: say where the time
        # went when it is close (twice seen under a load average of 8, cause not isolated)
        took = time.monotonic() - started
        (log.warning if took > 2 else log.info)(
            "shut down in %.2f s (saves %.2f s, loads and clients %.2f s)",
            took,
            saved - started,
            took - (saved - started),
        )
