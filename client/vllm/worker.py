"""The worker side of the connector: loads into the paged KV cache and saves out of it,
on threads of their own, so nothing blocks the engine step for a transfer.

- Loads: ``start_load_kv`` submits each load to loader threads, which fetch the pages
  the scheduler's lookup found (``KVCacheClient.get_found``: no second index round trip
  while that lookup's read lease is less than half gone), verified by checksum, and
  scatter them into the paged cache (``PagedCache``: per-layer strided copies in
  contiguous runs; on a GPU one host-to-device copy on a side stream).
  ``get_finished`` reports finished loads; blocks that did not arrive are reported
  through ``get_block_ids_with_load_errors`` no later than that, and vLLM recomputes
  them. Every worker reports every load it was given, so with several TP workers
  vLLM's ``KVOutputAggregator`` sees a request finished only once all have.
- Saves: ``wait_for_save`` copies the blocks out of the cache at the end of the step
  (on a GPU the device-to-host copy stays in flight on the compute stream, so the
  blocks can be reused by later steps safely) and publishes them on a saver thread.
  Pending saves are bounded by ``max_pending_save_bytes``; past it a save is dropped
  (counted), never waited for."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from client.landing import Landing, choose_landing
from client.sync_client import KVCacheClient
from client.vllm.events import SaveOutcomeLog, SaveOutcomes
from client.vllm.metadata import GatherSpec, KVStoreConnectorMetadata, LoadSpec, SaveSpec
from client.vllm.options import (
    ConnectorOptions,
    detect_layout,
    engine_layout,
    rank_client,
    stage_layers,
)
from client.vllm.paged_cache import GatherResult, PagedCache, StagingPool
from client.vllm.stats import StatsRecorder
from kvstore.errors import CredentialError, KVStoreError
from kvstore.pages import heads
from kvstore.settings.config import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
# A refused token is a configuration error the operator must see, but every load and
# save hits it: logged at ERROR the first time, then at most once a minute (counted
# every time in credential_refusals).
CREDENTIAL_LOG_EVERY_S = 60.0
# Longest an idle engine step waits in get_finished for a load to finish: short enough
# that a request arriving meanwhile is scheduled without a noticeable delay.
_IDLE_WAIT_S = 0.02


@dataclass
class _LoadOutcome:
    failed: list[int]
    nbytes: int
    seconds: float


class ConnectorWorker:
    """Worker-side state: the paged cache, its client, loader and saver threads, the
    staging pool, loads in flight and blocks that failed to load. Until
    ``register_kv_caches`` succeeds the worker cannot load: each load it is given is
    reported finished with every block failed (recomputed)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        conf: ConnectorOptions,
        options: ClientOptions,
        *,
        stats: StatsRecorder,
        enabled: bool = True,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        # Hybrid KV-cache groups (client.vllm.support.hybrid_groups): the group of each
        # layer of the cache, in its order; empty for one group.
        self._layer_groups: list[int] = []
        self._gathered: dict[str, GatherResult] = {}  # hybrid: each request's pages gathered so far
        self._enabled = enabled  # False: the engine cannot use the store (client.vllm.support); never loads or saves
        self._conf = conf
        self._options = options
        self._stats = stats
        self._credential_logged = -CREDENTIAL_LOG_EVERY_S  # monotonic time of the last ERROR line
        self._block_size = vllm_config.cache_config.block_size
        self._client: KVCacheClient | None = None
        self._cache: PagedCache | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future] = {}
        self._unloadable: set[str] = set()  # loads given to a worker that cannot load
        self._load_errors: set[int] = set()
        self._saving: set[Future] = set()
        self._pending_save_bytes = 0
        # answers for the scheduler's KV events (client.vllm.events)
        self._outcomes = SaveOutcomeLog()
        self._load_stream: Any = None
        self._staging: StagingPool | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self._enabled:
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        pp_rank = get_pp_group().rank_in_group
        try:
            start, end = stage_layers(self._vllm_config, pp_rank)
            indices = [extract_layer_index(n) for n in names]
            if indices != list(range(start, end)):  # pages name the stage's layers by position
                raise KVStoreError(
                    f"this worker's KV caches are of layers {indices}, not PP stage {pp_rank}'s {start} to {end - 1}"
                )
            expected = engine_layout(self._vllm_config)
            layout = detect_layout(
                tuple(layers[0].shape),
                self._block_size,
                heads,
                model.get_head_size(),
                mla=expected == "vllm_mla",
            )
            if layout != expected:
                raise KVStoreError(
                    f"KV layout {layout} differs from the scheduler's {expected} view"
                )
            self._cache = PagedCache(layers)
            self._layer_groups = self._groups_of(names)
        except KVStoreError as exc:
            log.error("KVStoreConnector disabled on this worker: %s", exc)
            return
        self._client = rank_client(
            self._vllm_config,
            self._conf,
            self._options,
            "WORKER",
            layout=layout,
            tp_rank=get_tp_group().rank_in_group,
            pp_rank=pp_rank,
        )
        buffers = self._conf.load_threads + 1  # every load at once, and one save
        self._staging = StagingPool(
            self._cache,
            buffers,
            self._conf.staging_bytes // buffers // self._client.namespace.page_nbytes,
        )
        self._loader = ThreadPoolExecutor(
            self._conf.load_threads, thread_name_prefix="kvstore-load"
        )
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        if self._cache.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=self._cache.device)

    def _groups_of(self, names: list[str]) -> list[int]:
        """Each layer's KV-cache group when there are several (else []): every layer
        reads and writes its own group's block ids."""
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        if len(groups) < 2:
            return []
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        missing = [n for n in names if n not in group_of]
        if missing:
            raise KVStoreError(f"KV caches {missing[:2]} are in no KV-cache group")
        return [group_of[n] for n in names]

    def _layer_rows(
        self, group_block_ids: list[list[int]], first: int, count: int
    ) -> list[tuple[list[int], list[int]]]:
        """Per layer, the rows ``0..count-1`` (positions ``first`` on) and their blocks in
        the layer's group, skipping positions where that group has the null block 0 (a
        sliding group below its window: vLLM keeps no block there)."""
        per_group = []
        for ids in group_block_ids:
            pairs = [(i, b) for i, b in enumerate(ids[first : first + count]) if b]
            per_group.append(([i for i, _ in pairs], [b for _, b in pairs]))
        return [per_group[g] for g in self._layer_groups]

    # ---- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        after = None
        if self._load_stream is not None:  # blocks were freed by earlier work on the compute stream
            after = torch.cuda.Event()
            after.record()
        for spec in meta.loads:
            if self._client is None or self._loader is None:
                with self._stats.lock:
                    self._load_errors.update(_ids_from(spec, spec.start_block))
                self._unloadable.add(spec.req_id)
                continue
            self._loading[spec.req_id] = self._loader.submit(self._load, spec, after)

    def _load(self, spec: LoadSpec, after: Any) -> _LoadOutcome:
        """Loader thread: fetch, verify and scatter one request's blocks. Never raises:
        whatever did not arrive is listed as failed."""
        started = time.perf_counter()
        wanted = spec.block_ids[spec.start_block :]
        got = spec.start_block
        pages = None
        hybrid_bytes = None
        taken: list[torch.Tensor] = []
        try:
            if self._layer_groups:
                got, hybrid_bytes = self._load_hybrid(spec, after, taken)
                return _LoadOutcome(
                    _ids_from(spec, max(got, spec.start_block)),
                    hybrid_bytes,
                    time.perf_counter() - started,
                )
            # how pages land: the client's gets choose the same way (client.landing)
            landing, spans = choose_landing(
                self._client.heads, lambda: self._cache.block_spans(wanted)
            )
            if landing is Landing.IN_PLACE:
                # Straight into the cache's blocks: from the node's mapped slots with one
                # copy on the same host (no host page buffer, no scatter); over UCX in
                # place when the cache is block-major, else through one scratch copy;
                # verified before get_finished reports the load.
                # Measured, 96 pages of 1.25 MiB (the TTFT bench's 120 MiB) into a
                # 10-layer CPU cache, 10 rounds interleaved: 22.0 ms (20.2-28.2) against
                # 29.5 ms (25.3-42.0) through a staging buffer and scatter.
                got = (
                    self._client.get_found_into(
                        spec.found, spans or [], start_block=spec.start_block
                    )
                    // self._block_size
                )
                parts = []
            elif landing is Landing.STAGED:
                pages = self._staging.take(len(spec.block_ids))
                got = (
                    self._client.get_found(spec.found, pages, start_block=spec.start_block)
                    // self._block_size
                )
                parts = [(pages[spec.start_block : got], 0, 0)]
            else:  # Landing.UNITS
                # Head groups: this rank's heads go from the fetched units straight into the
                # cache, from one buffer of the pool (no client staging, no merge into rank
                # pages). Measured, a TP=1 load of 96 blocks (60 MiB) stored by TP=2 ranks,
                # same host, 8 rounds interleaved: 17.7 ms against 22.2 ms merging first.
                units_pages = -(
                    -self._client.units_nbytes(spec.found.blocks - spec.start_block)
                    // self._client.namespace.page_nbytes
                )
                pages = self._staging.take(units_pages)
                units, blocks = self._client.get_found_units(
                    spec.found, pages, start_block=spec.start_block
                )
                got = spec.start_block + blocks
                parts = (
                    heads.rank_parts(self._client.namespace, units[:, :blocks], self._client.heads)
                    if blocks
                    else []
                )
            if got > spec.start_block:
                if after is not None:
                    self._load_stream.wait_event(after)
                for part, head_at, layer_at in parts:
                    self._cache.scatter(
                        part,
                        spec.block_ids[spec.start_block : got],
                        self._load_stream,
                        head_at=head_at,
                        layer_at=layer_at,
                    )
        except CredentialError as exc:
            self._credential_refused(exc)
            got = spec.start_block
        except Exception as exc:
            log.warning("load of %s failed: %s", spec.req_id, exc)
            got = spec.start_block
        finally:
            for held in ([pages] if pages is not None else []) + taken:
                self._staging.give(held)
        failed = _ids_from(spec, max(got, spec.start_block))
        if failed:
            log.warning(
                "request %s: %d of %d blocks could not be loaded and will be recomputed",
                spec.req_id,
                len(failed),
                len(wanted),
            )
        nbytes = (
            max(got, spec.start_block) - spec.start_block
        ) * self._client.namespace.page_nbytes
        return _LoadOutcome(failed, nbytes, time.perf_counter() - started)

    def _load_hybrid(
        self, spec: LoadSpec, after: Any, taken: list[torch.Tensor]
    ) -> tuple[int, int]:
        """Loader thread, hybrid groups: fetch whole pages (one block of every layer, as
        any engine of the model stores them) and write each layer's part into its own
        group's blocks, leaving out a sliding layer's positions below its window (vLLM
        gave those the null block: the layer never reads them). Returns the blocks that
        arrived (from 0) and the bytes written into the cache; the staging pages it takes
        are put in ``taken`` for the caller to give back, whatever happens. Never in
        place: a page's layers go to different groups' blocks."""
        client, cache, staging = self._registered()
        count = spec.found.blocks - spec.start_block
        if client.heads.identity:
            pages = staging.take(spec.found.blocks)
            taken.append(pages)
            got = (
                client.get_found(spec.found, pages, start_block=spec.start_block)
                // self._block_size
            )
            parts = [(pages[spec.start_block : got], 0, 0)]
        else:  # head groups: this rank's heads of each layer range, as Landing.UNITS
            units_pages = -(-client.units_nbytes(count) // client.namespace.page_nbytes)
            pages = staging.take(units_pages)
            taken.append(pages)
            units, blocks = client.get_found_units(spec.found, pages, start_block=spec.start_block)
            if units is None:  # a fault or the deadline: nothing arrived
                return spec.start_block, 0
            got = spec.start_block + blocks
            parts = (
                heads.rank_parts(client.namespace, units[:, :blocks], client.heads)
                if blocks
                else []
            )
        nbytes = 0
        if got > spec.start_block:
            if after is not None:
                self._load_stream.wait_event(after)
            rows = self._layer_rows(spec.group_block_ids, spec.start_block, got - spec.start_block)
            for part, head_at, layer_at in parts:
                nbytes += cache.scatter_layers(
                    part, rows, self._load_stream, head_at=head_at, layer_at=layer_at
                )
        return got, nbytes

    def _registered(self) -> tuple[KVCacheClient, PagedCache, StagingPool]:
        """The client, paged cache and staging pool of a worker whose
        ``register_kv_caches`` succeeded; raises ``KVStoreError`` on any other (its
        callers end that as a failed load or an unsaved request)."""
        if self._client is None or self._cache is None or self._staging is None:
            raise KVStoreError("this worker has no registered KV cache")
        return self._client, self._cache, self._staging

    def _release(self, held: GatherResult) -> None:
        """Give back a request's gathered pages that will not be published, and their
        bytes from the pending saves' count."""
        client, _, staging = self._registered()
        pages = held.wait()  # no copy may still land in pages given back
        staging.give(pages)
        with self._stats.lock:
            self._pending_save_bytes -= len(pages) * client.namespace.page_nbytes

    def get_finished(self, meta: Any) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (``meta``: this step's metadata, None
        when the step carried none)."""
        if (
            (self._loading or self._saving)
            and isinstance(meta, KVStoreConnectorMetadata)
            and meta.idle
        ):
            # The engine has nothing to compute and would call again at once: wait for
            # a load here instead, with the GIL released. Without this the in-process
            # engine loop spins and starves the loader and transfer threads: measured
            # in bench/vllm_ttft.py, a 120 MiB load took 4.6 s, and 0.41 s with the wait.
            # Saves too: an engine keeps stepping idle while a save's KV event waits for it.
            wait_futures(
                [*self._loading.values(), *self._saving],
                timeout=_IDLE_WAIT_S,
                return_when=FIRST_COMPLETED,
            )
        done, self._unloadable = self._unloadable, set()
        for req_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            outcome: _LoadOutcome = future.result()
            with self._stats.lock:
                self._load_errors.update(outcome.failed)
                self._stats.stats.add(
                    load_bytes=outcome.nbytes, load_failed_blocks=len(outcome.failed)
                )
                self._stats.stats.observe("load_seconds", outcome.seconds)
            done.add(req_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._stats.lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ---------------------------------------------------------------------

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        for req_id in meta.dropped:
            dropped = self._gathered.pop(req_id, None)
            if dropped is not None:
                self._release(dropped)
        if self._saver is None or not self._client.namespace.stores_heads:
            # Nothing to save here: this worker cannot (its saves' events are withheld),
            # or another rank holds the same replicated heads (MLA's latent) and saves them.
            self._outcomes.report(meta.saves, ok=self._saver is not None)
            return
        for gather in meta.gathers:
            try:
                self._gather(gather)
            except Exception as exc:  # a page not copied is a future miss, never an engine error
                log.warning(
                    "pages of %s not copied out, so it is not saved: %s", gather.req_id, exc
                )
                held = self._gathered.pop(gather.req_id, None)
                if held is not None:
                    self._release(held)
        page_nbytes = self._client.namespace.page_nbytes
        for spec in meta.saves:
            if spec.gathered:
                held = self._gathered.pop(spec.req_id, None)
                if held is None:  # a gather was dropped (pending bytes): nothing to publish
                    self._outcomes.report([spec], ok=False)
                    continue
                nbytes = len(held.pages) * page_nbytes
                future = self._saver.submit(self._save, spec, held, nbytes)
                self._saving.add(future)
                future.add_done_callback(self._saving.discard)
                continue
            nbytes = len(spec.block_ids) * page_nbytes
            with self._stats.lock:
                if self._pending_save_bytes + nbytes > self._conf.max_pending_save_bytes:
                    self._stats.stats.add(saves_dropped=1)
                    log.warning(
                        "save of %s dropped: %d bytes already wait to be published",
                        spec.req_id,
                        self._pending_save_bytes,
                    )
                    self._outcomes.report([spec], ok=False)
                    continue
                self._pending_save_bytes += nbytes
            started = time.perf_counter()
            gathered = self._cache.gather(spec.block_ids, self._staging.take(len(spec.block_ids)))
            self._stats.observe("save_gather_seconds", time.perf_counter() - started)
            future = self._saver.submit(self._save, spec, gathered, nbytes)
            self._saving.add(future)
            future.add_done_callback(self._saving.discard)

    def _gather(self, spec: GatherSpec) -> None:
        """Engine thread, hybrid groups: copy the request's blocks that became full this
        step into its pages (host memory held until its save is published or dropped).
        Its bytes count against ``max_pending_save_bytes`` from the first gather on; past
        it the request is not saved."""
        client, cache, staging = self._registered()
        held = self._gathered.get(spec.req_id)
        if held is None:
            if spec.first:  # an earlier gather was dropped: the pages would have a hole
                return
            nbytes = spec.blocks * client.namespace.page_nbytes
            with self._stats.lock:
                if self._pending_save_bytes + nbytes > self._conf.max_pending_save_bytes:
                    self._stats.stats.add(saves_dropped=1)
                    log.warning(
                        "save of %s dropped: %d bytes already wait to be published",
                        spec.req_id,
                        self._pending_save_bytes,
                    )
                    return
                self._pending_save_bytes += nbytes
            held = GatherResult(staging.take(spec.blocks))
            self._gathered[spec.req_id] = held
        started = time.perf_counter()
        count = len(spec.group_block_ids[0])
        rows = [
            ([spec.first + r for r in layer_rows], blocks)
            for layer_rows, blocks in self._layer_rows(spec.group_block_ids, 0, count)
        ]
        ready = cache.gather_layers(rows, held.pages[: spec.blocks]).ready
        self._gathered[spec.req_id] = GatherResult(held.pages[: spec.blocks], ready or held.ready)
        self._stats.observe("save_gather_seconds", time.perf_counter() - started)

    def _save(self, spec: SaveSpec, gathered: GatherResult, nbytes: int) -> None:
        """Saver thread: publish one request's pages; failures are counted, not raised."""
        started = time.perf_counter()
        stored = False
        try:
            report = self._client.put_pages(
                spec.token_ids, gathered.wait(), identity=spec.extras or None
            )
            stored = report.refused == 0  # every page of this rank's part on some node
            self._stats.count(save_bytes=report.bytes_sent)
            log.debug("saved %s: %s", spec.req_id, report)
        except CredentialError as exc:
            self._stats.count(save_failures=1)
            self._credential_refused(exc)
        except Exception as exc:
            self._stats.count(save_failures=1)
            log.warning("save of %s failed (a future miss, not an error): %s", spec.req_id, exc)
        finally:
            self._staging.give(gathered.pages)
            self._stats.observe("save_seconds", time.perf_counter() - started)
            with self._stats.lock:
                self._pending_save_bytes -= nbytes
            self._outcomes.report([spec], ok=stored)

    def take_save_outcomes(self) -> SaveOutcomes | None:
        """Outcomes of saves finished since the engine step last asked (its KV events)."""
        return self._outcomes.take()

    def _credential_refused(self, exc: CredentialError) -> None:
        """Loader or saver thread: every node refused the engine's token. The engine
        goes on (loads recompute, saves are future misses); counted, and logged at
        ERROR the first time and then at most once a minute."""
        self._stats.count(credential_refusals=1)
        with self._stats.lock:
            now = time.monotonic()
            if now - self._credential_logged < CREDENTIAL_LOG_EVERY_S:
                return
            self._credential_logged = now
        log.error(
            "the store refused this engine's credentials; loads recompute and saves are dropped until it is fixed "
            "(logged at most once a minute, counted in vllm:kvstore_credential_refusals_total): %s",
            exc,
        )

    def shutdown(self) -> None:
        """Finish the saves in flight (each is bounded by the client's timeout), then stop."""
        if self._saving:
            wait_futures(list(self._saving))
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        self._loader = self._saver = None
        if self._client is not None:
            self._client.close()
            self._client = None


def _ids_from(spec: LoadSpec, position: int) -> list[int]:
    """The block ids ``spec`` fills from ``position`` on, of every group (vLLM recomputes
    a request from its first block reported failed); never the null block 0."""
    groups = spec.group_block_ids or [spec.block_ids]
    return [b for ids in groups for b in ids[position:] if b]
