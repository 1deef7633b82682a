"""vLLM v1 KV connector backed by the store: ``KVStoreConnector``.

Configure a vLLM 0.32 engine with::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="client.vllm_connector",
                     kv_role="kv_both", kv_connector_extra_config={"redis_url": "redis://..."})

``KVStoreConnector`` is a facade: vLLM builds one per role, and it builds that role's
side (``client.vllm.scheduler.ConnectorScheduler`` or
``client.vllm.worker.ConnectorWorker``) and delegates every method to it. Nothing the
connector does blocks the engine step for a transfer:

- Scheduler: ``get_num_new_matched_tokens`` asks the index how many full blocks of the
  prompt are stored, waiting at most ``lookup_budget_ms``; past it, on an index fault,
  or while the circuit breaker is open, the request is a miss. A hit is loaded
  asynchronously (``load_kv_async=True``). ``build_connector_meta`` hands the workers
  the loads to start and the saves of requests whose prefill completed this step.
- Worker: loader threads fetch what the scheduler's lookup found, verified by checksum,
  and scatter it into the paged cache; blocks that did not arrive are recomputed. Saves
  copy the blocks out at the end of the step and publish them on a saver thread, so
  blocks never outlive their request (``request_finished`` returns False).
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
``breaker_cooldown_s``, ``load_threads``, ``staging_bytes``, ``max_pending_save_bytes``,
``kv_events``). Failed loads are recomputed: the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``
unless the extra config says ``"load_failure_policy": "fail"``.

KV events: an engine started with ``kv_events_config`` (``enable_kv_cache_events``)
publishes, besides its own events, a ``BlockStored`` (medium "CPU") for every save
whose pages every rank stored, through its own publisher and topic
(``client.vllm.events``: the fields, and why no ``BlockRemoved`` comes from here);
``"kv_events": false`` in the extra config turns the connector's off."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from client.memory.device_pages import DeviceCopier, default_copier
from client.stats import ClientStats
from client.vllm.drafts import draft_facts, draft_refusal
from client.vllm.events import SaveOutcomes
from client.vllm.features import build_scheduler
from client.vllm.metadata import KVStoreConnectorMetadata
from client.vllm.options import (
    connector_options,
    engine_layout,
    engine_namespace,
    namespace_refusal,
    required_cache_layout,
)
from client.vllm.preflight import check_config_being_built
from client.vllm.scheduler import ConnectorScheduler
from client.vllm.states import (
    state_facts,
    state_refusal,
)
from client.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics, StatsRecorder
from client.vllm.support import save_refusal, unsupported, vllm_ranks
from client.vllm.worker import ConnectorWorker
from client.vllm.worker_setup import WorkerFeatures, WorkerStores

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from client.vllm.store import PageStoreOpener

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
log = logging.getLogger(__name__)


class _NamesTheConnector(logging.Filter):
    """Starts every line of kvstore's loggers with "KVStoreConnector: ", so an operator
    reading an engine's log knows whose line it is (the client's own lines, such as
    "lookup failed, counting as a miss", do not say)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("KVStoreConnector"):
            record.msg = f"KVStoreConnector: {record.msg}"
        return True


def adopt_vllm_logging() -> None:
    """Give kvstore's loggers (``client.*``, ``kvstore.*``) handlers like vLLM's (its
    stream, format and level), each line naming the connector: vLLM configures only its
    own logger, so their INFO lines (the start line) were lost and their warnings
    reached stderr unformatted, naming neither the process nor the connector. Called by
    every connector; a logger the application configured itself is left alone."""
    engine = logging.getLogger("vllm")
    for name in ("client", "kvstore"):
        ours = logging.getLogger(name)
        if ours.handlers or not engine.handlers:
            continue
        for theirs in engine.handlers:
            handler = logging.StreamHandler(getattr(theirs, "stream", None))
            handler.setFormatter(theirs.formatter)
            handler.addFilter(_NamesTheConnector())
            ours.addHandler(handler)
        ours.setLevel(engine.getEffectiveLevel())
        ours.propagate = False


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM builds one per role (see the module docstring). ``SupportsHMA``: vLLM keeps
    its hybrid KV-cache manager on for engines that name this connector. Sliding-window
    models are then served with their groups' own block ids (``client.vllm.support``),
    Mamba and linear-attention hybrids with their states at block boundaries beside the
    attention pages (``client.vllm.states``; without the claim vLLM could not even
    start them: it would try to fold their state-space layers into one attention group)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        ranks: Callable[[], tuple[int, int]] = vllm_ranks,
        device: Callable[[ClientStats], DeviceCopier | None] = default_copier,
        stores: PageStoreOpener | None = None,
    ) -> None:
        """vLLM calls this with its three arguments. ``ranks``: the worker's (PP rank, TP
        rank), asked when its caches are registered; vLLM's process groups unless a
        caller without them (an in-process test) hands its own. ``device``: builds the
        worker client's device copier (``client.memory.device_pages``: CUDA's on a GPU;
        a test hands ``HostCopier`` to run the device path on the CPU). ``stores``: either
        side's stores, by namespace (``client.vllm.store``), a ``KVCacheClient`` each
        unless a caller without storage nodes (an in-process test) hands its own."""
        super().__init__(
            vllm_config=vllm_config,
            role=role,
            # vLLM types it as always given, but its base only stores it and the connector
            # also runs without one (a default kept for callers that build it directly);
            # vLLM's own Mooncake store connector makes the same call
            kv_cache_config=kv_cache_config,  # type: ignore[arg-type]
        )
        adopt_vllm_logging()
        # vllm_config.kv_transfer_config, which the base checked is set (it raises if not)
        transfer = self._kv_transfer_config
        conf, options = connector_options(dict(transfer.kv_connector_extra_config or {}))
        # A store is a cache: a block that fails to load must be recomputed, not fail the
        # request (vLLM's default). The scheduler reads this right after creating us.
        if conf.load_failure_policy == "recompute":
            transfer.kv_load_failure_policy = "recompute"
        self._stats = StatsRecorder()
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        # An engine the store cannot serve says so in one line and runs without it.
        drafts = draft_facts(vllm_config, kv_cache_config)
        states = state_facts(kv_cache_config)
        refusal = (
            unsupported(vllm_config, kv_cache_config)
            or state_refusal(vllm_config, states, conf.layer_groups)
            or (
                draft_refusal(vllm_config, kv_cache_config, drafts)
                if drafts is not None and kv_cache_config is not None
                else None
            )
            or namespace_refusal(vllm_config, conf)
        )
        if refusal is not None:
            (log.warning if role == KVConnectorRole.SCHEDULER else log.debug)(
                "KVStoreConnector: this engine cannot use the store, so it makes no lookups and no saves: %s",
                refusal,
            )
        if role == KVConnectorRole.SCHEDULER:
            # saves are the scheduler's to schedule: a worker is only handed those it makes
            cannot_save = None
            if refusal is None and transfer.is_kv_producer:
                rank_pages = engine_namespace(
                    vllm_config, conf, layout=engine_layout(vllm_config), tp_rank=0, pp_rank=0
                )
                cannot_save = save_refusal(rank_pages)
                if cannot_save is not None:
                    log.warning("KVStoreConnector: this engine makes no saves: %s", cannot_save)
            # vLLM 0.32 gives connectors the standardized per-layer view, so pages are
            # vllm_cpu (vllm_mla for MLA models); workers check that against the tensors
            # they actually get. Its stores are opened here, at engine start, so no
            # request pays for UCX set-up.
            self._scheduler = build_scheduler(
                vllm_config,
                kv_cache_config,
                conf,
                options,
                self._stats,
                loads=transfer.is_kv_consumer and refusal is None,
                saves=transfer.is_kv_producer and refusal is None and cannot_save is None,
                states=states,
                drafts=drafts,
                stores=stores,
            )
        else:
            self._worker = ConnectorWorker(
                vllm_config,
                conf,
                stats=self._stats,
                stores=WorkerStores(vllm_config, conf, options, opener=stores, device=device),
                features=WorkerFeatures(enabled=refusal is None, drafts=drafts, states=states),
                kv_cache_config=kv_cache_config,
                ranks=ranks,
            )

    @property
    def _scheduler_side(self) -> ConnectorScheduler:
        """The scheduler half, for the scheduler-side methods vLLM calls on the
        scheduler's connector only; raises RuntimeError on a worker's connector."""
        if self._scheduler is None:
            raise RuntimeError("KVStoreConnector: a scheduler-side call on a worker's connector")
        return self._scheduler

    @property
    def _worker_side(self) -> ConnectorWorker:
        """The worker half, for the worker-side methods vLLM calls on a worker's
        connector only; raises RuntimeError on the scheduler's connector."""
        if self._worker is None:
            raise RuntimeError("KVStoreConnector: a worker-side call on the scheduler's connector")
        return self._worker

    # ---- both sides ----------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM's engine core, once, before the KV cache is laid out: the byte order
        ``cache_layout`` asks for (``BLHNC`` for block_major), None for the backend's."""
        transfer = vllm_config.kv_transfer_config
        return required_cache_layout(
            dict(transfer.kv_connector_extra_config or {}) if transfer else {}
        )

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call instead of ``request_finished`` while its hybrid KV-cache manager
        is on (every engine naming this connector, unless HMA is off for another reason).
        Saves never hold blocks past their step, so nothing delays the free."""
        if self._scheduler is None:  # vLLM calls it on the scheduler's connector only
            return False, None
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_events()

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side.start_load_kv(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side.get_finished(
            self._get_connector_metadata() if self.has_connector_metadata() else None
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's, with the requests whose loads failed on a cache of several KV-cache
        groups (``client.vllm.load_errors``: vLLM takes those by request only)."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = self._worker_side.take_failed_loads()
        return results

    def get_kv_connector_kv_cache_events(self) -> SaveOutcomes | None:
        return self._worker.take_save_outcomes() if self._worker is not None else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves are gathered once per step in wait_for_save, from every layer

    def wait_for_save(self) -> None:
        self._worker_side.wait_for_save(self._get_connector_metadata())


# vLLM imports this module while it builds the engine's config, before any model loads:
# a configuration the connector cannot use stops the process here, in one line.
check_config_being_built()
