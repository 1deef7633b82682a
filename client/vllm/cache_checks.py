"""The KV caches vLLM registers on a worker, sorted and checked against what the
store's pages assume (``worker_caches``): the PP stage's attention layers in order, apart
from a draft model's and a state-space hybrid's state layers, the page layout the
scheduler keys by, and each layer's KV-cache group when there are several.

Called by ``client.vllm.worker.ConnectorWorker.register_kv_caches``; each check raises
``KVStoreError`` for caches the store cannot serve, which disables the worker's loads
and saves (logged once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from client.paging.paged_cache import PagedCache
from client.vllm.drafts import draft_layout
from client.vllm.options import engine_layout, stage_layers
from kvstore.errors import KVStoreError
from kvstore.pages.layouts import detect_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from client.vllm.states import StateFacts


@dataclass(frozen=True, slots=True)
class WorkerCaches:
    """A worker's registered caches, sorted and checked (``worker_caches``)."""

    names: list[str]  # the target model's attention caches, in layer order
    cache: PagedCache  # over those layers
    layout: str  # its page layout
    layer_groups: list[int]  # each layer's KV-cache group (``layer_groups_of``)
    draft: PagedCache | None  # the draft model's layers (client.vllm.drafts), if any
    draft_layout: str  # their page layout ("" without a draft)


def worker_caches(
    vllm_config: VllmConfig,
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    pp_rank: int,
    kv_cache_config: KVCacheConfig | None,
    draft_names: list[str],
    facts: StateFacts | None,
) -> WorkerCaches:
    """``kv_caches`` (vLLM's, by layer name) sorted into the target model's attention
    caches and the draft's (``draft_names``), leaving out a state-space hybrid's state
    layers (``facts``: ``client.vllm.states``), and checked (``stage_layout``,
    ``layer_groups_of``); raises ``KVStoreError`` for caches the store cannot serve,
    or a draft whose caches are not on this worker."""
    from vllm.model_executor.models.utils import extract_layer_index

    state_names = list(facts.state_layers) if facts is not None else []
    names = sorted(
        (n for n in kv_caches if n not in draft_names and n not in state_names),
        key=extract_layer_index,
    )
    layers = [kv_caches[n] for n in names]
    layout = stage_layout(
        vllm_config,
        names,
        layers,
        block_size,
        pp_rank,
        list(facts.page_layers) if facts is not None else None,
    )
    cache = PagedCache(layers, layout)
    layer_groups = layer_groups_of(
        kv_cache_config, names, list(facts.page_groups) if facts else None
    )
    missing = [n for n in draft_names if n not in kv_caches]
    if missing:  # the scheduler looks the draft's pages up: this worker must load them
        raise KVStoreError(f"the draft's KV caches {missing[:2]} are not on this worker")
    draft_caches = [kv_caches[n] for n in draft_names]
    draft_layout_tag = draft_layout(vllm_config, draft_caches) if draft_caches else ""
    draft_cache = PagedCache(draft_caches, draft_layout_tag) if draft_caches else None
    return WorkerCaches(names, cache, layout, layer_groups, draft_cache, draft_layout_tag)


def stage_layout(
    vllm_config: VllmConfig,
    names: list[str],
    layers: list[torch.Tensor],
    block_size: int,
    pp_rank: int,
    page_layers: list[str] | None = None,
) -> str:
    """The page layout of ``layers`` (the caches named ``names``, in layer order) on PP
    stage ``pp_rank``; raises ``KVStoreError`` when they are not that stage's layers
    (``page_layers``: the attention layers of a state-space hybrid) or their layout is
    not the scheduler's view (``engine_layout``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    model = vllm_config.model_config
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    start, end = stage_layers(vllm_config, pp_rank)
    indices = [extract_layer_index(n) for n in names]
    if page_layers is not None:
        if names != page_layers:
            raise KVStoreError(f"this worker's attention KV caches {names} are not {page_layers}")
    elif indices != list(range(start, end)):  # pages name the stage's layers by position
        raise KVStoreError(
            f"this worker's KV caches are of layers {indices}, "
            f"not PP stage {pp_rank}'s {start} to {end - 1}"
        )
    expected = engine_layout(vllm_config)
    layout = detect_layout(
        tuple(layers[0].shape),
        block_size,
        heads,
        model.get_head_size(),
        mla=expected == "vllm_mla",
    )
    if layout != expected:
        raise KVStoreError(f"KV layout {layout} differs from the scheduler's {expected} view")
    return layout


def layer_groups_of(
    kv_cache_config: KVCacheConfig | None, names: list[str], page_groups: list[int] | None = None
) -> list[int]:
    """Each layer's KV-cache group when there are several (else []): every layer
    reads and writes its own group's block ids. ``page_groups``: the groups whose blocks
    make pages (a state-space hybrid's attention groups), the numbers then counting
    among those. Raises ``KVStoreError`` for a cache in no group."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) < 2:
        return []
    chosen = list(range(len(groups))) if page_groups is None else page_groups
    group_of = {name: i for i, g in enumerate(chosen) for name in groups[g].layer_names}
    missing = [n for n in names if n not in group_of]
    if missing:
        raise KVStoreError(f"KV caches {missing[:2]} are in no KV-cache group")
    return [group_of[n] for n in names]
