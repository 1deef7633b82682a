"""vLLM v1 KV connector backed by the store: ``KVStoreConnector``.

Configure a vLLM 0.32 engine with::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="client.vllm_connector",
                     kv_role="kv_both", kv_connector_extra_config={"redis_url": "redis://..."})

Nothing the connector does blocks the engine step for a transfer:

- Scheduler: ``get_num_new_matched_tokens`` asks the index how many full blocks of the
  prompt are stored (always leaving one prompt token to compute), waiting at most
  ``lookup_budget_ms``; past it, on an index fault, or while the circuit breaker is
  open after repeated faults, the request is a miss. A hit is loaded asynchronously
  (``load_kv_async=True``): the request waits in WAITING_FOR_REMOTE_KVS while others
  keep running. ``build_connector_meta`` hands the workers the loads to start and the
  saves of requests whose prefill (possibly chunked) completed this step.
- Worker, loads: ``start_load_kv`` submits each load to loader threads, which fetch the
  pages the scheduler's lookup found (``KVCacheClient.get_found``: no second index round
  trip while that lookup's read lease is less than half gone), verified by checksum,
  and scatter them into the paged cache (``PagedCache``:
  per-layer strided copies in contiguous runs; on a GPU one host-to-device copy on a
  side stream). ``get_finished`` reports finished loads; blocks that did not arrive
  are reported through ``get_block_ids_with_load_errors`` no later than that, and vLLM
  recomputes them. Every worker reports every load it was given, so with several TP
  workers vLLM's ``KVOutputAggregator`` sees a request finished only once all have.
- Worker, saves: ``wait_for_save`` copies the blocks out of the cache at the end of the
  step (on a GPU the device-to-host copy stays in flight on the compute stream, so the
  blocks can be reused by later steps safely) and publishes them on a saver thread.
  Blocks therefore never outlive their request (``request_finished`` returns False).
  Pending saves are bounded by ``max_pending_save_bytes``; past it a save is dropped
  (counted), never waited for.
- Statistics go through vLLM's connector-stats interface (``KVStoreConnectorStats``,
  logged with the engine's stats) and to Prometheus as ``vllm:kvstore_*``
  (``build_prom_metrics``).

The namespace comes from the vLLM config (model, dtype, layers, KV heads per rank,
head size, block size, TP/PP rank) plus the KV layout detected from the registered
cache tensors. ``kv_connector_extra_config`` carries the client options
(``ClientOptions``: ``redis_url``, ``replicas``, ``timeout``, ``auth_token``,
``ucx_progress_mode``, ...; the same names as the KVSTORE_* environment variables,
validated the same way) plus the connector's own (``ConnectorOptions``: ``tenant``,
``model``, ``load_failure_policy``, ``lookup_budget_ms``, ``breaker_failures``,
``breaker_cooldown_s``, ``load_threads``, ``staging_bytes``, ``max_pending_save_bytes``). Failed loads are
recomputed: the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``
unless the extra config says ``"load_failure_policy": "fail"``."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from client.async_client import StoredPrefix
from client.breaker import CircuitBreaker
from client.paged_cache import GatherResult, PagedCache, StagingPool
from client.sync_client import KVCacheClient
from client.vllm_stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.errors import InvalidInputError, KVStoreError
from kvstore.pages.namespace import Namespace, Tenant
from kvstore.settings.config import ByteSize, ClientOptions, client_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# Longest an idle engine step waits in get_finished for a load to finish: short enough
# that a request arriving meanwhile is scheduled without a noticeable delay.
_IDLE_WAIT_S = 0.02


def detect_layout(shape: tuple[int, ...], block_size: int, num_kv_heads: int, head_size: int) -> str:
    """Page layout tag for a per-layer KV cache tensor of ``shape``.

    vLLM's standardized per-layer view (the CPU backend and 0.32's connector view) is
    ``[blocks, kv_heads, block_size, 2 * head_size]``: pages ``vllm_cpu``. The
    FlashAttention layout ``[2, blocks, block_size, kv_heads, head_size]``: ``vllm_flash``."""
    if len(shape) == 4 and tuple(shape[1:]) == (num_kv_heads, block_size, 2 * head_size):
        return "vllm_cpu"
    if len(shape) == 5 and shape[0] == 2 and tuple(shape[2:]) == (block_size, num_kv_heads, head_size):
        return "vllm_flash"
    raise KVStoreError(
        f"unsupported KV cache layout {tuple(shape)} for block_size={block_size}, "
        f"kv_heads={num_kv_heads}, head_size={head_size}"
    )


def engine_namespace(vllm_config: VllmConfig, conf: ConnectorOptions, *, layout: str, tp_rank: int, pp_rank: int) -> Namespace:
    """The namespace of this engine's pages for one TP/PP rank."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else {
        "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"
    }.get(cache.cache_dtype, cache.cache_dtype)
    return Namespace(
        model=str(conf.model or model.model),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        block_size=cache.block_size,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        total_kv_heads=model.get_total_num_kv_heads(),
        head_groups=conf.head_groups,
        pp_rank=pp_rank,
        tenant=conf.tenant,
    )


class ConnectorOptions(BaseModel):
    """The connector's own keys in ``kv_connector_extra_config`` (every other key is a
    client option)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: Tenant = Field("default", description="namespace tenant: whose pages these are (credentials and index ACLs are per tenant)")
    model: str | None = Field(None, description="model name shared by engines that load the same weights from different paths")
    load_failure_policy: Literal["recompute", "fail"] = Field("recompute", description="what vLLM does with blocks that fail to load")
    lookup_budget_ms: float = Field(50.0, gt=0, le=10_000, allow_inf_nan=False,
                                    description="longest the scheduler waits for an index lookup; past it the request is a miss")
    breaker_failures: int = Field(3, ge=1, le=1000, description="consecutive lookup faults that open the circuit breaker")
    breaker_cooldown_s: float = Field(2.0, gt=0, le=600, allow_inf_nan=False,
                                      description="seconds the open breaker answers every lookup with a miss before one probe")
    load_threads: int = Field(2, ge=1, le=64, description="loads running at once on each worker")
    staging_bytes: ByteSize = Field(512 << 20, description="host page buffers allocated at start and reused by loads and saves, per worker (0: allocate per transfer)")
    max_pending_save_bytes: ByteSize = Field(2 << 30, description="page bytes waiting to be published, per worker, past which saves are dropped")
    head_groups: int = Field(0, ge=0, description="groups the KV heads are stored in (docs/key-format.md): engines of different TP sizes share pages when they give the same value, at least their largest tp_size (0: this engine's tp_size)")


def connector_options(extra: dict[str, Any]) -> tuple[ConnectorOptions, ClientOptions]:
    """Split and validate ``kv_connector_extra_config``; a bad value raises
    ``InvalidInputError`` naming the key."""
    if "redis_url" not in extra:
        raise InvalidInputError("kv_connector_extra_config must carry redis_url for KVStoreConnector")
    own = {k: v for k, v in extra.items() if k in ConnectorOptions.model_fields}
    try:
        options = ConnectorOptions.model_validate(own)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidInputError(f"invalid kv_connector_extra_config {'.'.join(map(str, err['loc']))}={err.get('input')!r}: {err['msg']}") from None
    return options, client_options(**{k: v for k, v in extra.items() if k not in own})


def lookup_breaker(conf: ConnectorOptions) -> CircuitBreaker:
    """The scheduler's breaker: backs off to 30 s, or to the configured cooldown when
    that is longer (every cooldown ``ConnectorOptions`` accepts must build one)."""
    return CircuitBreaker(conf.breaker_failures, conf.breaker_cooldown_s, max_cooldown=max(30.0, conf.breaker_cooldown_s))


@dataclass
class LoadSpec:
    """Fill ``block_ids[start_block:]`` from the store (the first blocks are computed)
    with what the scheduler's lookup ``found``: workers fetch it without asking the
    index again (``KVCacheClient.get_found``)."""

    req_id: str
    found: StoredPrefix
    block_ids: list[int]
    start_block: int


@dataclass
class SaveSpec:
    """Publish the full blocks ``block_ids`` of ``token_ids`` (pages the store already
    holds are skipped by the storage nodes, so loaded blocks cost no transfer)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: the engine only waits for transfers


def request_switch(params: dict[str, Any] | None, name: str, req_id: str) -> bool:
    """A per-request switch (``kvstore_load``, ``kvstore_save``) from the request's
    ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``):
    on unless set to False. A value that is not a boolean is logged as an error naming
    the request and the key, and the switch stays on: raising here would stop the
    scheduler, and so every other request."""
    if not isinstance(params, dict) or name not in params:
        return True
    value = params[name]
    if isinstance(value, bool):
        return value
    log.error("request %s: kv_transfer_params[%r] must be true or false, got %r; left on", req_id, name, value)
    return True


@dataclass
class _Tracked:
    """Scheduler-side state of a request the connector may save."""

    prompt: list[int]
    block_ids: list[int]
    stored_blocks: int = 0
    saved: bool = False


@dataclass
class _LoadOutcome:
    failed: list[int]
    nbytes: int
    seconds: float


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._conf, self._options = connector_options(dict(transfer.kv_connector_extra_config or {}))
        # A store is a cache: a block that fails to load must be recomputed, not fail the
        # request (vLLM's default). The scheduler reads this right after creating us.
        if self._conf.load_failure_policy == "recompute":
            transfer.kv_load_failure_policy = "recompute"
        self._block_size = vllm_config.cache_config.block_size
        self._saves_enabled = transfer.is_kv_producer
        self._loads_enabled = transfer.is_kv_consumer
        self._client: KVCacheClient | None = None
        self._stats = KVStoreConnectorStats()
        self._stats_lock = threading.Lock()
        # scheduler side
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loaded_blocks: dict[str, list[int]] = {}  # req id -> blocks a load fills
        self._tracked: dict[str, _Tracked] = {}
        self._breaker = lookup_breaker(self._conf)
        # worker side
        self._cache: PagedCache | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future] = {}
        self._unloadable: set[str] = set()  # loads given to a worker that cannot load
        self._load_errors: set[int] = set()
        self._saving: set[Future] = set()
        self._pending_save_bytes = 0
        self._load_stream: Any = None
        self._staging: StagingPool | None = None
        if role == KVConnectorRole.SCHEDULER and self._loads_enabled:
            # vLLM 0.32 gives connectors the standardized per-layer view, so pages are
            # vllm_cpu; workers check that against the tensors they actually get.
            # Made here, at engine start, so no request pays for UCX set-up.
            self._client = self._make_client("vllm_cpu", tp_rank=0, pp_rank=0, all_heads=True)

    # ---- shared ------------------------------------------------------------------

    def _make_client(self, layout: str, tp_rank: int, pp_rank: int, all_heads: bool = False) -> KVCacheClient:
        """A client for one rank's pages; with ``all_heads`` (the scheduler) for every head
        group, so a lookup counts a block only when every worker can load it."""
        ns = engine_namespace(self._vllm_config, self._conf, layout=layout, tp_rank=tp_rank, pp_rank=pp_rank)
        if all_heads:  # the storage namespace is the TP=1 view of every head group
            ns = ns.storage
        log.info("KVStoreConnector (%s) namespace %s: %s", self.role.name, ns.digest_hex, ns.canonical_json())
        return KVCacheClient(None, ns, options=self._options)

    def _count(self, **counts: float) -> None:
        with self._stats_lock:
            self._stats.add(**counts)

    def _observe(self, name: str, seconds: float) -> None:
        with self._stats_lock:
            self._stats.observe(name, seconds)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----------------------------------------------------------

    def _find(self, tokens: list[int]) -> StoredPrefix | None:
        """The stored prefix of ``tokens``; None (a miss) past the budget, on a fault or
        while the breaker is open. Never waits longer than the budget (plus the
        cancellation's unwinding)."""
        if not self._breaker.allow():
            self._count(lookups_skipped=1)
            return None
        started = time.perf_counter()
        found = self._client.find(tokens, timeout=self._conf.lookup_budget_ms / 1000)
        seconds = time.perf_counter() - started
        self._breaker.record(found is not None)
        with self._stats_lock:
            self._stats.add(lookups=1, lookup_prompt_tokens=len(tokens), lookup_hit_tokens=found.tokens if found else 0,
                            lookup_faults=found is None)
            self._stats.observe("lookup_seconds", seconds)
        if found is None and self._breaker.state != "closed":
            log.warning("index lookups keep failing: every request is a miss for the next %.1f s", self._breaker.current_cooldown)
        return found

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._loads_enabled or self._client is None:
            return 0, False
        if not request_switch(request.kv_transfer_params, "kvstore_load", request.request_id):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable = (len(prompt) - 1) // self._block_size * self._block_size  # always compute >= 1 token
        if usable <= num_computed_tokens:
            return 0, False
        pending = self._pending_loads.get(request.request_id)
        if pending is not None and pending.start_block * self._block_size == num_computed_tokens:
            found: StoredPrefix | None = pending.found  # asked again while waiting for blocks: reuse
        else:
            found = self._find(prompt[:usable])
        new = (found.tokens if found else 0) - num_computed_tokens
        if found is None or new <= 0:
            self._pending_loads.pop(request.request_id, None)
            return 0, False
        self._pending_loads[request.request_id] = LoadSpec(request.request_id, found, [], num_computed_tokens // self._block_size)
        return new, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        spec = self._pending_loads.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens == 0:
            del self._pending_loads[request.request_id]
            return
        spec.block_ids = list(blocks.get_block_ids()[0])[: spec.found.tokens // self._block_size]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        for req_id, spec in list(self._pending_loads.items()):
            if spec.block_ids:
                meta.loads.append(spec)
                self._loaded_blocks[req_id] = spec.block_ids
                del self._pending_loads[req_id]
        if self._saves_enabled:
            self._track(scheduler_output)
            computed_after = self._computed_after_step(scheduler_output)
            for req_id, tracked in self._tracked.items():
                computed = computed_after.get(req_id)
                if tracked.saved or computed is None or computed < len(tracked.prompt):
                    continue
                tracked.saved = True  # prefill complete (possibly over several chunks)
                full = len(tracked.prompt) // self._block_size
                if full > tracked.stored_blocks:
                    meta.saves.append(SaveSpec(req_id, tracked.prompt[: full * self._block_size], tracked.block_ids[:full]))
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _track(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the block lists of scheduled requests (for their saves)."""
        for new in scheduler_output.scheduled_new_reqs:
            loaded = self._loaded_blocks.pop(new.req_id, [])
            extra = new.sampling_params.extra_args if new.sampling_params is not None else None
            if not request_switch((extra or {}).get("kv_transfer_params"), "kvstore_save", new.req_id):
                continue  # never tracked: nothing gathered or published
            self._tracked[new.req_id] = _Tracked(list(new.prompt_token_ids or []), list(new.block_ids[0]), len(loaded))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            new_blocks = cached.new_block_ids[i]
            if tracked is None or new_blocks is None:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and resumed: a fresh block list
                tracked.block_ids = list(new_blocks[0])
            else:
                tracked.block_ids.extend(new_blocks[0])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed, so they must be saved again."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for req_id, blocks in self._loaded_blocks.items():
            bad = [i for i, b in enumerate(blocks) if b in invalid]
            if bad:
                self._loaded_blocks[req_id] = blocks[: bad[0]]

    @staticmethod
    def _computed_after_step(scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Tokens each scheduled request will have computed once this step has run."""
        before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = scheduler_output.num_scheduled_tokens
        return {req_id: done + scheduled[req_id] for req_id, done in before.items() if req_id in scheduled}

    def _forget(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._loaded_blocks.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out before the step ends, so blocks never outlive the
        # request; an in-flight load of an aborted request is waited for by vLLM itself
        # (it frees the blocks once get_finished reports the load).
        self._forget(request.request_id)
        return False, None

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        try:
            layout = detect_layout(tuple(layers[0].shape), self._block_size, heads, model.get_head_size())
            if layout != "vllm_cpu":
                raise KVStoreError(f"KV layout {layout} differs from the scheduler's vllm_cpu view")
            self._cache = PagedCache(layers)
        except KVStoreError as exc:
            log.error("KVStoreConnector disabled on this worker: %s", exc)
            return
        self._client = self._make_client(layout, tp_rank=get_tp_group().rank_in_group, pp_rank=get_pp_group().rank_in_group)
        buffers = self._conf.load_threads + 1  # every load at once, and one save
        self._staging = StagingPool(self._cache, buffers, self._conf.staging_bytes // buffers // self._client.namespace.page_nbytes)
        self._loader = ThreadPoolExecutor(self._conf.load_threads, thread_name_prefix="kvstore-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        if self._cache.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=self._cache.device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        after = None
        if self._load_stream is not None:  # blocks were freed by earlier work on the compute stream
            after = torch.cuda.Event()
            after.record()
        for spec in meta.loads:
            if self._client is None or self._loader is None:
                with self._stats_lock:
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
            pages = self._staging.take(len(spec.block_ids))
            got = self._client.get_found(spec.found, pages, start_block=spec.start_block) // self._block_size
            if got > spec.start_block:
                if after is not None:
                    self._load_stream.wait_event(after)
                self._cache.scatter(pages[spec.start_block : got], spec.block_ids[spec.start_block : got], self._load_stream)
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._loading and isinstance(meta, KVStoreConnectorMetadata) and meta.idle:
            # The engine has nothing to compute and would call again at once: wait for
            # a load here instead, with the GIL released. Without this the in-process
            # engine loop spins and starves the loader and transfer threads: measured
            # in bench/vllm_ttft.py, a 120 MiB load took 4.6 s, and 0.41 s with the wait.
            wait_futures(list(self._loading.values()), timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done, self._unloadable = self._unloadable, set()
        for req_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            outcome: _LoadOutcome = future.result()
            with self._stats_lock:
                self._load_errors.update(outcome.failed)
                self._stats.add(load_bytes=outcome.nbytes, load_failed_blocks=len(outcome.failed))
                self._stats.observe("load_seconds", outcome.seconds)
            done.add(req_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._stats_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before their request is scheduled again

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are gathered once per step in wait_for_save, from every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or self._saver is None:
            return
        page_nbytes = self._client.namespace.page_nbytes
        for spec in meta.saves:
            nbytes = len(spec.block_ids) * page_nbytes
            with self._stats_lock:
                if self._pending_save_bytes + nbytes > self._conf.max_pending_save_bytes:
                    self._stats.add(saves_dropped=1)
                    log.warning("save of %s dropped: %d bytes already wait to be published", spec.req_id, self._pending_save_bytes)
                    continue
                self._pending_save_bytes += nbytes
            started = time.perf_counter()
            gathered = self._cache.gather(spec.block_ids, self._staging.take(len(spec.block_ids)))
            self._observe("save_gather_seconds", time.perf_counter() - started)
            future = self._saver.submit(self._save, spec, gathered, nbytes)
            self._saving.add(future)
            future.add_done_callback(self._saving.discard)

    def _save(self, spec: SaveSpec, gathered: GatherResult, nbytes: int) -> None:
        """Saver thread: publish one request's pages; failures are counted, not raised."""
        started = time.perf_counter()
        try:
            report = self._client.put_pages(spec.token_ids, gathered.wait())
            self._count(save_bytes=report.bytes_sent)
            log.debug("saved %s: %s", spec.req_id, report)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            self._count(save_failures=1)
            log.warning("save of %s failed (a future miss, not an error): %s", spec.req_id, exc)
        finally:
            self._staging.give(gathered.pages)
            self._observe("save_seconds", time.perf_counter() - started)
            with self._stats_lock:
                self._pending_save_bytes -= nbytes

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
