"""The connector's options, the engine's namespace and per-request switches: what
both sides of the connector read from vLLM's config and requests."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.memory.device_pages import DeviceCopier, default_copier
from client.paging.breaker import CircuitBreaker
from client.stats import ClientStats
from client.sync_client import KVCacheClient
from client.vllm.start_line import start_line
from client.vllm.support import cache_dtype
from client.vllm.weights import engine_weights
from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import Namespace, Tenant
from kvstore.settings.client import ClientOptions, client_options, client_options_from_env
from kvstore.settings.config import ByteSize, first_error
from kvstore.settings.events import EventProfileName

if TYPE_CHECKING:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

log = logging.getLogger(__name__)
# The client's host-buffer pool in an engine worker (``host_buffer_bytes``), unless the
# extra config says otherwise: see connector_options.
CONNECTOR_HOST_BUFFER_BYTES = 128 << 20


def engine_layout(vllm_config: VllmConfig) -> str:
    """The page layout of this engine's connector view: ``vllm_mla`` for MLA models
    (DeepSeek-V2/V3/R1, Kimi-K2), else ``vllm_cpu``."""
    return "vllm_mla" if vllm_config.model_config.use_mla else "vllm_cpu"


class ConnectorOptions(BaseModel):
    """The connector's own keys in ``kv_connector_extra_config`` (every other key is a
    client option)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: Tenant = Field(
        "default",
        description="namespace tenant: whose pages these are (credentials and index ACLs are per tenant)",
    )
    model: str | None = Field(
        None,
        description="model name shared by engines that load the same weights from different paths",
    )
    load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="what vLLM does with blocks that fail to load"
    )
    lookup_budget_ms: float = Field(
        50.0,
        gt=0,
        le=10_000,
        allow_inf_nan=False,
        description="longest the scheduler waits for an index lookup; past it the request is a miss",
    )
    remote_prefill_wait_ms: float = Field(
        5000.0,
        gt=0,
        le=600_000,
        allow_inf_nan=False,
        description=(
            "longest a decode waits for the pages its prefill engine announced (P/D:"
            " kv_transfer_params); past it the blocks not yet stored are recomputed"
        ),
    )
    breaker_failures: int = Field(
        3, ge=1, le=1000, description="consecutive lookup faults that open the circuit breaker"
    )
    breaker_cooldown_s: float = Field(
        2.0,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="seconds the open breaker answers every lookup with a miss before one probe",
    )
    load_threads: int = Field(2, ge=1, le=64, description="loads running at once on each worker")
    layerwise_loads: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "load a hit during the forward pass, layer by layer, instead of before the request"
            " is scheduled (auto: on CUDA engines without hybrid groups or a draft; never on"
            " a hybrid engine)"
        ),
    )
    cache_layout: Literal["engine", "block_major"] = Field(
        "engine",
        description=(
            "the KV cache byte order asked of vLLM: engine (the backend's) or block_major"
            " (BLHNC: a block of every layer is one page, so whole loads on a GPU land in"
            " its blocks, unscattered; vLLM warns and keeps its own where it cannot)"
        ),
    )
    staging_bytes: ByteSize = Field(
        512 << 20,
        description=(
            "host page buffers allocated at start and reused by loads and saves, per worker"
            " (0: allocate per transfer)"
        ),
    )
    max_pending_save_bytes: ByteSize = Field(
        2 << 30,
        description="page bytes waiting to be published, per worker, past which saves are dropped",
    )
    head_groups: int = Field(
        0,
        ge=0,
        description=(
            "groups the KV heads are stored in (docs/key-format.md): engines of different TP"
            " sizes share pages when they give the same value, at least their largest tp_size"
            " (0: this engine's tp_size)"
        ),
    )
    kv_events: bool = Field(
        True,
        description=(
            "announce saved blocks as BlockStored through the engine's KV events"
            " (only when the engine publishes them: kv_events_config)"
        ),
    )
    kv_events_profile: EventProfileName = Field(
        "vllm",
        description=(
            "the routers those events are shaped for: vllm (locality REMOTE, ownership"
            " kvstore: a consumer tells the store's blocks apart) or dynamo (integer block"
            " hashes and neither mark, which NVIDIA Dynamo's KV indexer needs to keep them)"
        ),
    )
    layer_groups: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "groups the layers are stored in (docs/key-format.md): engines of different PP"
            " sizes share pages when they give the same value, a multiple of their largest"
            " pipeline_parallel_size whose stages hold whole groups"
            " (0: this engine's pipeline_parallel_size)"
        ),
    )


def connector_options(extra: dict[str, Any]) -> tuple[ConnectorOptions, ClientOptions]:
    """Split and validate ``kv_connector_extra_config``; a bad value raises
    ``InvalidInputError`` naming the key. A client option the JSON leaves out comes
    from its ``KVSTORE_*`` variable, as for any client (what ``kvstore up`` prints and
    the chart's NOTES set); the JSON wins. No index URL in either is an error."""
    env = client_options_from_env()
    from_env = {name: getattr(env, name) for name in env.model_fields_set}
    for pair in (("auth_token", "auth_token_file"), ("redis_password", "redis_password_file")):
        if any(
            name in extra for name in pair
        ):  # the JSON's secret wins whole, in whichever form it is given
            for name in pair:
                from_env.pop(name, None)
    if "redis_url" not in extra and "redis_url" not in from_env:
        raise InvalidInputError(
            "KVStoreConnector has no index URL: put redis_url in kv_connector_extra_config or export KVSTORE_REDIS_URL"
        )
    unknown_key(extra)
    options = own_options(extra)
    # The client's share of the process's one pool holds UCX scratch (a load into the
    # layer-major cache lands each message there first) and packing; staging_bytes is
    # the connector's share on top (client.memory.staging). Measured in
    # bench/vllm_ttft.py's warm engine over UCX (120 MiB, 96 messages): with no pool
    # every message got fresh memory and the load took 300-620 ms; with a pool 74-87 ms.
    # A few messages in flight fit in 128 MiB.
    client = {
        "host_buffer_bytes": CONNECTOR_HOST_BUFFER_BYTES,
        **from_env,
        **{k: v for k, v in extra.items() if k not in ConnectorOptions.model_fields},
    }
    return options, client_options(**client)


def unknown_key(extra: dict[str, Any]) -> None:
    """Raise ``InvalidInputError`` for the first key of ``kv_connector_extra_config`` that
    is neither a connector nor a client option, naming the closest of either kind."""
    kinds = {name: "connector" for name in ConnectorOptions.model_fields}
    kinds.update((name, "client") for name in ClientOptions.model_fields)
    for key in extra:
        if key in kinds:
            continue
        close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.6)
        hint = (
            f"; did you mean the {kinds[close[0]]} option {close[0]}?"
            if close
            else " (docs/vllm-connector.md lists the connector's options, docs/operations.md"
            " the client's)"
        )
        raise InvalidInputError(f"kv_connector_extra_config has no option {key!r}{hint}")


def layerwise_loads(conf: ConnectorOptions, *, hybrid: bool, draft: bool) -> bool:
    """Whether hits load during the forward pass, layer by layer (``layerwise_loads``;
    auto: on CUDA engines, where loads land straight in device memory, without hybrid
    groups or a draft, whose pages land whole). Never on a hybrid engine, ``on`` or
    not: vLLM takes its failed loads only by request, for loads the request waits on
    before it is scheduled (``client.vllm.load_errors``), and a layer-wise load's
    failure would stop the engine."""
    if hybrid:
        return False
    if conf.layerwise_loads != "auto":
        return conf.layerwise_loads == "on"
    from vllm.platforms import current_platform

    return current_platform.is_cuda() and not hybrid and not draft


def own_options(extra: dict[str, Any]) -> ConnectorOptions:
    """The connector's keys of ``extra``, validated (``InvalidInputError`` names a bad one)."""
    own = {k: v for k, v in extra.items() if k in ConnectorOptions.model_fields}
    try:
        return ConnectorOptions.model_validate(own)
    except ValidationError as exc:
        name, shown, message = first_error(exc)
        raise InvalidInputError(
            f"invalid kv_connector_extra_config {name}={shown}: {message}"
        ) from None


def required_cache_layout(extra: dict[str, Any]) -> str | None:
    """The KV cache layout asked of vLLM (``cache_layout``): ``BLHNC`` for block_major,
    else None (the backend's). The engine core asks before any connector is built."""
    return "BLHNC" if own_options(extra).cache_layout == "block_major" else None


def lookup_breaker(conf: ConnectorOptions) -> CircuitBreaker:
    """The scheduler's breaker: backs off to 30 s, or to the configured cooldown when
    that is longer (every cooldown ``ConnectorOptions`` accepts must build one)."""
    return CircuitBreaker(
        conf.breaker_failures,
        conf.breaker_cooldown_s,
        max_cooldown=max(30.0, conf.breaker_cooldown_s),
    )


def stage_layers(vllm_config: VllmConfig, pp_rank: int) -> tuple[int, int]:
    """The model layers ``[start, end)`` pipeline stage ``pp_rank`` holds (vLLM's split,
    ``VLLM_PP_LAYER_PARTITION`` included)."""
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return get_pp_indices(total, pp_rank, vllm_config.parallel_config.pipeline_parallel_size)


def layer_groups(vllm_config: VllmConfig, conf: ConnectorOptions) -> int:
    """The layer groups this engine stores pages in: the option, else its PP size."""
    return conf.layer_groups or vllm_config.parallel_config.pipeline_parallel_size


def engine_namespace(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    *,
    layout: str,
    tp_rank: int,
    pp_rank: int,
    weights: str = "",
    page_layers: int | None = None,
) -> Namespace:
    """The namespace of this engine's pages for one TP/PP rank; ``weights``: its
    ``engine_weights``. With layer groups (pipeline parallelism, or ``layer_groups``) it
    names the stage's layers among the model's, so every PP split shares the storage.
    ``page_layers``: the layers a page holds when not every layer of the stage
    (a state-space hybrid's attention layers, ``client.vllm.states``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    groups = layer_groups(vllm_config, conf)
    start, end = stage_layers(vllm_config, pp_rank)
    layers = (
        {
            "total_layers": model.get_total_num_hidden_layers(),
            "first_layer": start,
            "layer_groups": groups,
        }
        if groups > 1
        else {}
    )
    return model_namespace(
        vllm_config,
        conf,
        model,
        parallel,
        name=str(conf.model or model.model),
        num_layers=page_layers or end - start,
        layout=layout,
        tp_rank=tp_rank,
        weights=weights,
        pp_rank=pp_rank,
        **layers,
    )


def model_namespace(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    name: str,
    num_layers: int,
    layout: str,
    tp_rank: int,
    weights: str,
    **stage: int,
) -> Namespace:
    """The namespace of ``model``'s pages (the engine's, or a speculative draft's:
    ``client.vllm.drafts``) on TP rank ``tp_rank`` of ``parallel``, in this engine's
    cache dtype and block size; ``stage``: its PP rank and layer groups."""
    mla = (
        model.use_mla
    )  # one latent "head", replicated on every TP rank (stored once: stores_heads)
    return Namespace(
        model=name,
        dtype=cache_dtype(vllm_config),
        num_layers=num_layers,
        num_kv_heads=1 if mla else model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        total_kv_heads=1 if mla else model.get_total_num_kv_heads(),
        head_groups=conf.head_groups,
        tenant=conf.tenant,
        weights=weights,
        **stage,
    )


def namespace_refusal(vllm_config: VllmConfig, conf: ConnectorOptions) -> str | None:
    """Why no namespace can name some rank's pages (a PP split whose stages do not hold
    whole layer groups, a rank with part of the heads and several layer groups); None
    when every TP and PP rank has one. Asked once at start, by both sides."""
    parallel = vllm_config.parallel_config
    for pp_rank in range(parallel.pipeline_parallel_size):
        for tp_rank in range(parallel.tensor_parallel_size):
            try:
                engine_namespace(
                    vllm_config,
                    conf,
                    layout=engine_layout(vllm_config),
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                )
            except ValidationError as exc:
                _, _, message = first_error(exc)
                return f"TP rank {tp_rank} of PP stage {pp_rank}: {message.removeprefix('Value error, ')}"
    return None


def rank_client(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    side: str,
    *,
    layout: str,
    tp_rank: int,
    pp_rank: int,
    all_heads: bool = False,
    device: Callable[[ClientStats], DeviceCopier | None] = default_copier,
    page_layers: int | None = None,
) -> KVCacheClient:
    """A client for one rank's pages; with ``all_heads`` (the scheduler) for every head
    group, so a lookup counts a block only when every worker can load it.
    ``page_layers``: as ``engine_namespace``'s."""
    ns = engine_namespace(
        vllm_config,
        conf,
        layout=layout,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        weights=engine_weights(vllm_config, options),
        page_layers=page_layers,
    )
    if all_heads:  # the storage namespace is the TP=1 view of every head group
        ns = ns.storage
    client = KVCacheClient(None, ns, options=options, device=device)
    line, well = start_line(client, options)
    (log.info if well else log.warning)("KVStoreConnector (%s): %s", side, line)
    return client
