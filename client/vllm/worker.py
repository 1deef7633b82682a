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
from client.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from client.vllm.options import ConnectorOptions, detect_layout, engine_layout, rank_client, stage_layers
from client.vllm.paged_cache import GatherResult, PagedCache, StagingPool
from client.vllm.stats import StatsRecorder
from kvstore.errors import CredentialError, KVStoreError
from kvstore.pages import heads
from kvstore.settings.config import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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

    def __init__(self, vllm_config: VllmConfig, conf: ConnectorOptions, options: ClientOptions, *, stats: StatsRecorder, enabled: bool = True) -> None:
        self._vllm_config = vllm_config
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
        self._outcomes = SaveOutcomeLog()  # answers for the scheduler's KV events (client.vllm.events)
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
                raise KVStoreError(f"this worker's KV caches are of layers {indices}, not PP stage {pp_rank}'s {start} to {end - 1}")
            expected = engine_layout(self._vllm_config)
            layout = detect_layout(tuple(layers[0].shape), self._block_size, heads, model.get_head_size(), mla=expected == "vllm_mla")
            if layout != expected:
                raise KVStoreError(f"KV layout {layout} differs from the scheduler's {expected} view")
            self._cache = PagedCache(layers)
        except KVStoreError as exc:
            log.error("KVStoreConnector disabled on this worker: %s", exc)
            return
        self._client = rank_client(self._vllm_config, self._conf, self._options, "WORKER", layout=layout,
                                   tp_rank=get_tp_group().rank_in_group, pp_rank=pp_rank)
        buffers = self._conf.load_threads + 1  # every load at once, and one save
        self._staging = StagingPool(self._cache, buffers, self._conf.staging_bytes // buffers // self._client.namespace.page_nbytes)
        self._loader = ThreadPoolExecutor(self._conf.load_threads, thread_name_prefix="kvstore-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        if self._cache.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=self._cache.device)

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
                    self._load_errors.update(spec.block_ids[spec.start_block :])
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
        try:
            # how pages land: the client's gets choose the same way (client.landing)
            landing, spans = choose_landing(self._client.heads, lambda: self._cache.block_spans(wanted))
            if landing is Landing.IN_PLACE:
                # Straight into the cache's blocks: from the node's mapped slots with one
                # copy on the same host (no host page buffer, no scatter); over UCX in
                # place when the cache is block-major, else through one scratch copy;
                # verified before get_finished reports the load.
                # Measured, 96 pages of 1.25 MiB (the TTFT bench's 120 MiB) into a
                # 10-layer CPU cache, 10 rounds interleaved: 22.0 ms (20.2-28.2) against
                # 29.5 ms (25.3-42.0) through a staging buffer and scatter.
                got = self._client.get_found_into(spec.found, spans or [], start_block=spec.start_block) // self._block_size
                parts = []
            elif landing is Landing.STAGED:
                pages = self._staging.take(len(spec.block_ids))
                got = self._client.get_found(spec.found, pages, start_block=spec.start_block) // self._block_size
                parts = [(pages[spec.start_block : got], 0, 0)]
            else:  # Landing.UNITS
                # Head groups: this rank's heads go from the fetched units straight into the
                # cache, from one buffer of the pool (no client staging, no merge into rank
                # pages). Measured, a TP=1 load of 96 blocks (60 MiB) stored by TP=2 ranks,
                # same host, 8 rounds interleaved: 17.7 ms against 22.2 ms merging first.
                units_pages = -(-self._client.units_nbytes(spec.found.blocks - spec.start_block) // self._client.namespace.page_nbytes)
                pages = self._staging.take(units_pages)
                units, blocks = self._client.get_found_units(spec.found, pages, start_block=spec.start_block)
                got = spec.start_block + blocks
                parts = heads.rank_parts(self._client.namespace, units[:, :blocks], self._client.heads) if blocks else []
            if got > spec.start_block:
                if after is not None:
                    self._load_stream.wait_event(after)
                for part, head_at, layer_at in parts:
                    self._cache.scatter(part, spec.block_ids[spec.start_block : got], self._load_stream, head_at=head_at, layer_at=layer_at)
        except CredentialError as exc:
            self._credential_refused(exc)
            got = spec.start_block
        except Exception as exc:  # noqa: BLE001 - a load must end as blocks to recompute, whatever broke
            log.warning("load of %s failed: %s", spec.req_id, exc)
            got = spec.start_block
        finally:
            if pages is not None:
                self._staging.give(pages)
        failed = spec.block_ids[max(got, spec.start_block) :]
        if failed:
            log.warning("request %s: %d of %d blocks could not be loaded and will be recomputed",
                        spec.req_id, len(failed), len(wanted))
        nbytes = (max(got, spec.start_block) - spec.start_block) * self._client.namespace.page_nbytes
        return _LoadOutcome(failed, nbytes, time.perf_counter() - started)

    def get_finished(self, meta: Any) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (``meta``: this step's metadata, None
        when the step carried none)."""
        if (self._loading or self._saving) and isinstance(meta, KVStoreConnectorMetadata) and meta.idle:
            # The engine has nothing to compute and would call again at once: wait for
            # a load here instead, with the GIL released. Without this the in-process
            # engine loop spins and starves the loader and transfer threads: measured
            # in bench/vllm_ttft.py, a 120 MiB load took 4.6 s, and 0.41 s with the wait.
            # Saves too: an engine keeps stepping idle while a save's KV event waits for it.
            wait_futures([*self._loading.values(), *self._saving], timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done, self._unloadable = self._unloadable, set()
        for req_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            outcome: _LoadOutcome = future.result()
            with self._stats.lock:
                self._load_errors.update(outcome.failed)
                self._stats.stats.add(load_bytes=outcome.nbytes, load_failed_blocks=len(outcome.failed))
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
        if self._saver is None or not self._client.namespace.stores_heads:
            # Nothing to save here: this worker cannot (its saves' events are withheld),
            # or another rank holds the same replicated heads (MLA's latent) and saves them.
            self._outcomes.report(meta.saves, ok=self._saver is not None)
            return
        page_nbytes = self._client.namespace.page_nbytes
        for spec in meta.saves:
            nbytes = len(spec.block_ids) * page_nbytes
            with self._stats.lock:
                if self._pending_save_bytes + nbytes > self._conf.max_pending_save_bytes:
                    self._stats.stats.add(saves_dropped=1)
                    log.warning("save of %s dropped: %d bytes already wait to be published", spec.req_id, self._pending_save_bytes)
                    self._outcomes.report([spec], ok=False)
                    continue
                self._pending_save_bytes += nbytes
            started = time.perf_counter()
            gathered = self._cache.gather(spec.block_ids, self._staging.take(len(spec.block_ids)))
            self._stats.observe("save_gather_seconds", time.perf_counter() - started)
            future = self._saver.submit(self._save, spec, gathered, nbytes)
            self._saving.add(future)
            future.add_done_callback(self._saving.discard)

    def _save(self, spec: SaveSpec, gathered: GatherResult, nbytes: int) -> None:
        """Saver thread: publish one request's pages; failures are counted, not raised."""
        started = time.perf_counter()
        stored = False
        try:
            report = self._client.put_pages(spec.token_ids, gathered.wait(), identity=spec.extras or None)
            stored = report.refused == 0  # every page of this rank's part on some node
            self._stats.count(save_bytes=report.bytes_sent)
            log.debug("saved %s: %s", spec.req_id, report)
        except CredentialError as exc:
            self._stats.count(save_failures=1)
            self._credential_refused(exc)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
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
        log.error("the store refused this engine's credentials; loads recompute and saves are dropped until it is fixed "
                  "(logged at most once a minute, counted in vllm:kvstore_credential_refusals_total): %s", exc)

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
