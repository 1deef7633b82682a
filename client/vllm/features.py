"""``build_scheduler``: the one place that reads the scheduler side's features
(``SchedulerFeatures``, client.vllm.feature_set) off vLLM's config at engine start and
opens the stores they look up in.

``KVStoreConnector`` calls it for its scheduler role; ``ConnectorScheduler`` takes the
features as they are (``client.vllm.scheduler``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client.vllm.drafts import DraftFacts, draft_namespace, rank_draft_client
from client.vllm.events import StoredEvents
from client.vllm.feature_set import SchedulerFeatures
from client.vllm.options import (
    ConnectorOptions,
    engine_layout,
    engine_namespace,
    layerwise_loads,
    rank_client,
)
from client.vllm.scheduler import ConnectorScheduler
from client.vllm.states import StateFacts, page_namespace_layers, rank_state_client, state_namespace
from client.vllm.stats import StatsRecorder
from client.vllm.store import PrefixStore, StoreOpener
from client.vllm.support import hybrid_groups
from client.vllm.weights import engine_weights
from kvstore.events.profiles import PROFILES
from kvstore.settings.client import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def build_scheduler(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    conf: ConnectorOptions,
    options: ClientOptions,
    stats: StatsRecorder,
    *,
    loads: bool,
    saves: bool,
    states: StateFacts | None,
    drafts: DraftFacts | None,
    stores: StoreOpener | None = None,
) -> ConnectorScheduler:
    """The engine's scheduler side: ``loads`` (a consumer the store can serve) opens
    the stores it looks up in, a ``KVCacheClient`` per namespace (``stores``: a caller's
    own, by namespace); ``saves`` publishes KV events when the engine does."""
    hybrid = hybrid_groups(kv_cache_config)
    main = state_store = draft = None
    if loads:
        main, state_store, draft = _open(vllm_config, conf, options, states, drafts, stores)
    block_size = vllm_config.cache_config.block_size
    events_config = vllm_config.kv_events_config
    events = None
    if (
        saves
        and conf.kv_events
        and events_config is not None
        and events_config.enable_kv_cache_events
    ):
        events = StoredEvents(
            block_size,
            vllm_config.parallel_config.world_size,
            kv_cache_config=kv_cache_config,
            stats=stats,
            profile=PROFILES[conf.kv_events_profile],
        )
    features = SchedulerFeatures(
        saves=saves,
        hybrid=hybrid,
        layerwise=layerwise_loads(conf, hybrid=hybrid, draft=drafts is not None),
        states=states,
        state_store=state_store,
        draft=draft,
        draft_drop=drafts.drop_blocks if drafts is not None else 0,
    )
    return ConnectorScheduler(conf, main, block_size, stats=stats, events=events, features=features)


def _open(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    states: StateFacts | None,
    drafts: DraftFacts | None,
    stores: StoreOpener | None,
) -> tuple[PrefixStore, PrefixStore | None, PrefixStore | None]:
    """The stores of the engine's pages, its boundary states and its draft's pages (the
    storage view of every head group: a lookup counts a block only when every worker
    can load it)."""
    if stores is None:
        main: PrefixStore = rank_client(
            vllm_config,
            conf,
            options,
            "SCHEDULER",
            layout=engine_layout(vllm_config),
            tp_rank=0,
            pp_rank=0,
            all_heads=True,
            page_layers=page_namespace_layers(states),
        )
        state_store = (
            rank_state_client(vllm_config, conf, options, states, "SCHEDULER", all_heads=True)
            if states is not None
            else None
        )
        draft = (
            rank_draft_client(vllm_config, conf, options, drafts, "SCHEDULER", all_heads=True)
            if drafts is not None
            else None
        )
        return main, state_store, draft
    layout = engine_layout(vllm_config)
    ns = engine_namespace(
        vllm_config,
        conf,
        layout=layout,
        tp_rank=0,
        pp_rank=0,
        weights=engine_weights(vllm_config, options),
        page_layers=page_namespace_layers(states),
    )
    return (
        stores(ns.storage),
        None
        if states is None
        else stores(state_namespace(vllm_config, conf, options, states, tp_rank=0).storage),
        None
        if drafts is None
        else stores(
            draft_namespace(vllm_config, conf, options, drafts, layout=layout, tp_rank=0).storage
        ),
    )
