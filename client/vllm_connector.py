"""vLLM v1 KV connector backed by the store: ``KVStoreConnector``.

Configure a vLLM 0.32 engine with::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="client.vllm_connector",
                     kv_role="kv_both", kv_connector_extra_config={"redis_url": "redis://..."})

Scheduler side: ``get_num_new_matched_tokens`` asks the index, in one round trip, how
many full blocks of the prompt are stored (always leaving at least one prompt token
to compute); ``update_state_after_alloc`` remembers the block ids to fill;
``build_connector_meta`` hands the workers the loads and the saves of this step
(a save once a request's prefill, possibly chunked, has completed).

Worker side: ``start_load_kv`` fetches the pages (one prefix fetch per request,
verified by checksum) and scatters them into the paged KV cache before the forward
pass; blocks that did not arrive are reported by ``get_block_ids_with_load_errors``
so vLLM recomputes them, and nothing unverified is written into the cache.
``wait_for_save`` gathers the full blocks of finished prefills from every layer and
publishes them; blocks the store already holds are not sent again.

The namespace comes from the vLLM config (model, dtype, layers, KV heads per rank,
head size, block size, TP/PP rank) plus the KV layout detected from the registered
cache tensors. ``kv_connector_extra_config`` carries the client options
(``ClientOptions``: ``redis_url``, ``replicas``, ``timeout``, ``auth_token``, ...; the
same names as the KVSTORE_* environment variables, validated the same way) plus
``tenant``, ``model`` (a name shared by engines that load the same weights from
different paths) and ``load_failure_policy``. Failed loads are
recomputed: the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``
unless the extra config says ``"load_failure_policy": "fail"``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from client.sync_client import KVCacheClient
from kvstore.config import ClientOptions, client_options
from kvstore.errors import KVStoreError
from kvstore.namespace import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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


def engine_namespace(vllm_config: VllmConfig, extra: dict[str, Any], *, layout: str, tp_rank: int, pp_rank: int) -> Namespace:
    """The namespace of this engine's pages for one TP/PP rank."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else {
        "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"
    }.get(cache.cache_dtype, cache.cache_dtype)
    return Namespace(
        model=str(extra.get("model") or model.model),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        block_size=cache.block_size,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        pp_rank=pp_rank,
        tenant=str(extra.get("tenant", "default")),
    )


# extra-config keys the connector reads itself; every other key is a client option
CONNECTOR_KEYS = frozenset({"tenant", "model", "load_failure_policy"})


@dataclass
class LoadSpec:
    """Fill ``block_ids[start_block:]`` from the store (the first blocks are computed)."""

    req_id: str
    token_ids: list[int]
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


@dataclass
class _Tracked:
    """Scheduler-side state of a request the connector may save."""

    prompt: list[int]
    block_ids: list[int]
    stored_blocks: int = 0
    saved: bool = False


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        if "redis_url" not in self._extra:
            raise KVStoreError("kv_connector_extra_config must carry redis_url for KVStoreConnector")
        self._options: ClientOptions = client_options(**{k: v for k, v in self._extra.items() if k not in CONNECTOR_KEYS})
        # A store is a cache: a block that fails to load must be recomputed, not fail the
        # request (vLLM's default). The scheduler reads this right after creating us.
        if self._extra.get("load_failure_policy", "recompute") == "recompute":
            transfer.kv_load_failure_policy = "recompute"
        self._block_size = vllm_config.cache_config.block_size
        self._saves_enabled = transfer.is_kv_producer
        self._loads_enabled = transfer.is_kv_consumer
        self._client: KVCacheClient | None = None
        # scheduler side
        self._pending_loads: dict[str, LoadSpec] = {}
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._layers: list[torch.Tensor] = []
        self._layout: str | None = None
        self._load_errors: set[int] = set()

    # ---- shared ------------------------------------------------------------------

    def _make_client(self, layout: str, tp_rank: int, pp_rank: int) -> KVCacheClient:
        ns = engine_namespace(self._vllm_config, self._extra, layout=layout, tp_rank=tp_rank, pp_rank=pp_rank)
        log.info("KVStoreConnector (%s) namespace %s: %s", self.role.name, ns.digest_hex, ns.canonical_json())
        return KVCacheClient(None, ns, options=self._options)

    def _scheduler_client(self) -> KVCacheClient:
        """Created on first use: by then the engine core has resolved the KV cache layout.
        vLLM 0.32 gives connectors the standardized per-layer view, so pages are vllm_cpu;
        workers check that against the tensors they actually get."""
        if self._client is None:
            self._client = self._make_client("vllm_cpu", tp_rank=0, pp_rank=0)
        return self._client

    # ---- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._loads_enabled:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable = (len(prompt) - 1) // self._block_size * self._block_size  # always compute >= 1 token
        if usable <= num_computed_tokens:
            return 0, False
        try:
            stored = self._scheduler_client().lookup(prompt[:usable])
        except KVStoreError as exc:  # e.g. a namespace problem: behave as a miss
            log.warning("lookup failed, computing the prompt: %s", exc)
            return 0, False
        new = stored - num_computed_tokens
        if new <= 0:
            return 0, False
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id, prompt[:stored], [], num_computed_tokens // self._block_size
        )
        return new, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        spec = self._pending_loads.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens == 0:
            del self._pending_loads[request.request_id]
            return
        spec.block_ids = list(blocks.get_block_ids()[0])[: len(spec.token_ids) // self._block_size]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for spec in self._pending_loads.values():
            if spec.block_ids:
                meta.loads.append(spec)
        loaded = {s.req_id: len(s.token_ids) // self._block_size for s in meta.loads}
        self._pending_loads.clear()
        if self._saves_enabled:
            for new in scheduler_output.scheduled_new_reqs:
                self._tracked[new.req_id] = _Tracked(list(new.prompt_token_ids or []), list(new.block_ids[0]), loaded.get(new.req_id, 0))
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
            self._tracked.pop(req_id, None)
        return meta

    @staticmethod
    def _computed_after_step(scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Tokens each scheduled request will have computed once this step has run."""
        before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = scheduler_output.num_scheduled_tokens
        return {req_id: done + scheduled[req_id] for req_id, done in before.items() if req_id in scheduled}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[n] for n in names]
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        try:
            layout = detect_layout(tuple(self._layers[0].shape), self._block_size, heads, model.get_head_size())
            if layout != "vllm_cpu":
                raise KVStoreError(f"KV layout {layout} differs from the scheduler's vllm_cpu view")
        except KVStoreError as exc:
            log.error("KVStoreConnector disabled on this worker: %s", exc)
            self._layout = None
            return
        self._layout = layout
        self._client = self._make_client(layout, tp_rank=get_tp_group().rank_in_group, pp_rank=get_pp_group().rank_in_group)

    def _page_tensor(self, count: int, device: str = "cpu") -> torch.Tensor:
        return torch.empty((count, *self._client.namespace.page_shape), dtype=self._layers[0].dtype, device=device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        for spec in meta.loads:
            if self._client is None:
                self._load_errors.update(spec.block_ids[spec.start_block :])
                continue
            pages = self._page_tensor(len(spec.block_ids))
            try:
                got = self._client.get_pages(spec.token_ids, pages, start_block=spec.start_block) // self._block_size
            except KVStoreError as exc:
                log.warning("load of %s failed: %s", spec.req_id, exc)
                got = 0
            if got > spec.start_block:
                self._scatter(pages[spec.start_block : got], spec.block_ids[spec.start_block : got])
            failed = spec.block_ids[max(got, spec.start_block) :]
            if failed:
                self._load_errors.update(failed)
                log.warning("request %s: %d of %d blocks could not be loaded and will be recomputed",
                            spec.req_id, len(failed), len(spec.block_ids) - spec.start_block)

    def _scatter(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        """Write verified pages ``[n, layers, heads, block, 2*head]`` into the paged cache."""
        device = self._layers[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        pages = pages.to(device, non_blocking=True)
        for layer, kv in enumerate(self._layers):
            kv.index_copy_(0, idx, pages[:, layer])

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._layers[0].device)
        pages = self._page_tensor(len(block_ids))
        for layer, kv in enumerate(self._layers):
            pages[:, layer].copy_(kv.index_select(0, idx))
        return pages

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv finishes every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are gathered once per step in wait_for_save, from every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or self._client is None:
            return
        for spec in meta.saves:
            pages = self._gather(spec.block_ids)
            try:
                report = self._client.put_pages(spec.token_ids, pages)
            except KVStoreError as exc:
                log.warning("save of %s failed (a future miss, not an error): %s", spec.req_id, exc)
                continue
            log.debug("saved %s: %s", spec.req_id, report)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
