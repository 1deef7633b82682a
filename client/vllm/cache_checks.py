"""Checks of the KV caches vLLM registers on a worker against what the store's pages
assume: the PP stage's layers in order, the page layout the scheduler keys by, and each
layer's KV-cache group when there are several.

Called by ``client.vllm.worker.ConnectorWorker.register_kv_caches``; each check raises
``KVStoreError`` for caches the store cannot serve, which disables the worker's loads
and saves (logged once)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from client.vllm.options import engine_layout, stage_layers
from kvstore.errors import KVStoreError
from kvstore.pages.layouts import detect_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


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
