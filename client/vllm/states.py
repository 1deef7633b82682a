"""Hybrid state-space models (Mamba, gated-delta and other linear-attention layers beside
attention): their states at block boundaries, stored beside the attention pages.

vLLM 0.32 with prefix caching keeps such a layer's state only at block boundaries
(``mamba_cache_mode="align"``): the state after token ``n * block_size`` lives in the
layer's block at position ``n - 1`` of its KV-cache group, and each step the scheduler
hands connectors the boundaries it just cached
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: group, block,
boundary tokens), which the step's forward computes. A hit of ``n`` blocks needs the
attention pages of blocks ``0..n-1`` and the state at boundary ``n``, which goes into
the block vLLM allocates at position ``n - 1`` of each state group (the others are null).

The store keeps them apart:
- the attention layers' pages as ever, one page per block over those layers only
  (``StateFacts.page_layers``);
- each boundary state as one page of its own namespace (layout ``vllm_mamba_state``:
  every state layer's block bytes, ``[layers, 1, state bytes]``), published as block
  ``n - 1`` of the prompt's chain alone (``put_pages(start_block=n - 1)``), so its key
  is the prefix's hash under the request's identity. TP ranks hold their share of a
  state each (head groups of one "head" per rank, as attention pages of one KV head per
  rank), so only engines of one TP size share states; ``tp_replicated`` states are
  written by rank 0 only.

The scheduler finds the attention prefix, then the last state stored within it
(``KVCacheClient.find(last=True)``: one more index round trip); the hit ends there.
Used by ``client.vllm.scheduler`` (``boundary_saves``, the lookup's second half),
``client.vllm.state_pages`` (the worker's side) and ``KVStoreConnector``
(``state_refusal``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from client.sync_client import KVCacheClient
from client.vllm.options import ConnectorOptions, engine_layout, engine_namespace
from client.vllm.weights import engine_weights
from kvstore.errors import KVStoreError
from kvstore.pages.identity import NO_EXTRAS, BlockExtras
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import ClientOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
STATE_LAYOUT = "vllm_mamba_state"
STATE_SPEC = "MambaSpec"  # vLLM's spec of every state-space and linear-attention layer


@dataclass(frozen=True)
class StateFacts:
    """The KV-cache groups of a hybrid state-space engine, as both sides see them:
    ``page_groups`` hold attention layers (their blocks make pages), ``state_groups``
    state layers (``state_layers``, by name, each ``state_bytes`` of real state per
    block, after which vLLM pads); ``replicated``: every TP rank holds the whole state."""

    page_groups: tuple[int, ...]
    state_groups: tuple[int, ...]
    state_layers: tuple[str, ...]
    page_layers: tuple[str, ...]
    state_bytes: int
    replicated: bool
    mode: str
    block_size: int
    # what the state's bytes mean: its kind, each tensor's dtype and shape, the conv
    # layout (part of the states' namespace: engines that read the bytes alike share)
    state_format: str = ""
    uniform: bool = True  # every state group's spec alike (one page shape per state)

    def state_group_of(self, layer: str, kv_cache_config: KVCacheConfig) -> int:
        """The index in ``state_groups`` of ``layer``'s group."""
        for i, g in enumerate(self.state_groups):
            if layer in kv_cache_config.kv_cache_groups[g].layer_names:
                return i
        raise KVStoreError(f"state layer {layer} is in no state group")


def state_facts(kv_cache_config: KVCacheConfig | None) -> StateFacts | None:
    """The engine's ``StateFacts``; None when it has no state-space layers."""
    if kv_cache_config is None:
        return None
    from vllm.model_executor.models.utils import extract_layer_index

    groups = kv_cache_config.kv_cache_groups
    states = [
        g for g, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == STATE_SPEC
    ]
    if not states:
        return None
    spec = groups[states[0]].kv_cache_spec
    pages = [g for g in range(len(groups)) if g not in states]
    formats = {_state_format(groups[g].kv_cache_spec) for g in states}

    def layers(ids: list[int]) -> tuple[str, ...]:
        names = [n for g in ids for n in groups[g].layer_names]
        return tuple(sorted(names, key=extract_layer_index))

    return StateFacts(
        page_groups=tuple(pages),
        state_groups=tuple(states),
        state_layers=layers(states),
        page_layers=layers(pages),
        state_bytes=int(spec.real_page_size_bytes),  # type: ignore[attr-defined]
        replicated=bool(getattr(spec, "tp_replicated", False)),
        mode=str(getattr(spec, "mamba_cache_mode", "none")),
        block_size=int(spec.block_size),
        state_format=_state_format(spec),
        uniform=len(formats) == 1,
    )


def _state_format(spec: object) -> str:
    """A state spec's format: kind, each tensor's dtype and shape, whether TP ranks
    replicate it, and vLLM's conv-state layout where one is set (how the bytes read)."""
    kind = getattr(spec, "mamba_type", "")
    tensors = ";".join(
        f"{str(dtype).removeprefix('torch.')}{tuple(shape)}"
        for shape, dtype in zip(
            getattr(spec, "shapes", ()), getattr(spec, "dtypes", ()), strict=True
        )
    )
    layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")
    replicated = "replicated" if getattr(spec, "tp_replicated", False) else "split"
    return f"{getattr(kind, 'name', kind)}:{tensors}:{replicated}:{layout}"


def state_refusal(
    vllm_config: VllmConfig, facts: StateFacts | None, layer_groups: int = 0
) -> str | None:
    """Why this hybrid state-space engine's states cannot be stored (one line at start,
    as ``client.vllm.support``'s refusals); None when they can, or it has none.
    ``layer_groups``: the connector's option of that name."""
    if facts is None:
        return None
    what = f"state-space layers ({len(facts.state_layers)} in {len(facts.state_groups)} groups)"
    if not facts.uniform:
        return f"{what} of different state formats (kinds, sizes or TP splits)"
    if layer_groups > 1:
        return f"{what} with layer_groups {layer_groups}: a hybrid's pages are one layer group"
    if facts.mode != "align":
        return (
            f"{what} in mamba_cache_mode {facts.mode!r}: kvstore stores the block-boundary "
            "states of 'align' mode only (vLLM's mode with prefix caching on)"
        )
    if not facts.page_groups:
        return f"{what} and no attention layers"
    if facts.block_size != vllm_config.cache_config.block_size:
        return f"{what} of block size {facts.block_size}, not the cache's {vllm_config.cache_config.block_size}"
    if vllm_config.speculative_config is not None:
        return f"{what} beside speculative decoding: draft states are not stored"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return f"{what} with pipeline parallelism: hybrid stages are not stored yet"
    return None


def page_namespace_layers(facts: StateFacts | None) -> int | None:
    """The layers of an attention page: the attention layers of a state-space hybrid
    (None: the stage's layers, every one of them attention)."""
    return len(facts.page_layers) if facts is not None else None


def state_namespace(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    facts: StateFacts,
    *,
    tp_rank: int,
) -> Namespace:
    """The namespace of TP rank ``tp_rank``'s share of the boundary states: the
    engine's (model, tenant, weights, block size) with the state layers' bytes as its
    page, one "head" per rank (or one replicated head)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    base = engine_namespace(
        vllm_config,
        conf,
        layout=engine_layout(vllm_config),
        tp_rank=tp_rank,
        pp_rank=0,
        weights=engine_weights(vllm_config, options),
    )
    return base.model_copy(
        update={
            "dtype": "int8",
            "layout": STATE_LAYOUT,
            "num_layers": len(facts.state_layers),
            "num_kv_heads": 1,
            "head_size": facts.state_bytes,
            "total_kv_heads": 1 if facts.replicated else tp,
            "head_groups": 0,
            "total_layers": 0,
            "first_layer": 0,
            "layer_groups": 0,
            "state": facts.state_format,
        }
    )


def rank_state_client(
    vllm_config: VllmConfig,
    conf: ConnectorOptions,
    options: ClientOptions,
    facts: StateFacts,
    side: str,
    *,
    tp_rank: int = 0,
    all_heads: bool = False,
) -> KVCacheClient:
    """A client for one rank's share of the states (``all_heads``: the scheduler's, for
    every rank's). Logs one line naming the namespace."""
    ns = state_namespace(vllm_config, conf, options, facts, tp_rank=tp_rank)
    if all_heads:
        ns = ns.storage
    client = KVCacheClient(None, ns, options=options)
    log.info(
        "KVStoreConnector (%s): the states of %d state-space layer(s) (%d bytes each) are "
        "stored at block boundaries under namespace %s",
        side,
        len(facts.state_layers),
        facts.state_bytes,
        ns.digest_hex,
    )
    return client


@dataclass
class StateSpec:
    """Publish the state at boundary ``len(token_ids)`` (a multiple of the block size),
    which each state group keeps in its block ``block_ids[g]``, under ``extras``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    extras: BlockExtras = NO_EXTRAS


def boundary_saves(
    scheduler_output: SchedulerOutput,
    facts: StateFacts,
    prompt_of: Callable[[str], tuple[list[int], BlockExtras] | None],
) -> list[StateSpec]:
    """Scheduler thread, ``build_connector_meta``: the boundary states this step computes
    that the connector saves, each once every state group handed its block over.
    ``prompt_of(req_id)``: the request's saved prompt and identity (``(tokens, extras)``)
    or None when it is not saved. Boundaries past the prompt (its generated tokens, not
    keyed), inside a block (vLLM's partial tails) or in the null block are skipped."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(state, "boundary_state_offloads", None) or {}
    size = facts.block_size
    saves = []
    for req_id, entries in offloads.items():
        prompt = prompt_of(req_id)
        if prompt is None:
            continue
        tokens, extras = prompt
        found: dict[int, dict[int, int]] = {}  # boundary -> state group -> its block
        for group, block, boundary in entries:
            whole = 0 < boundary <= len(tokens) and boundary % size == 0
            if group in facts.state_groups and block and whole:
                found.setdefault(boundary, {})[group] = block
        for boundary, blocks in sorted(found.items()):
            if len(blocks) == len(facts.state_groups):
                ids = [blocks[g] for g in facts.state_groups]
                saves.append(StateSpec(req_id, tokens[:boundary], ids, extras))
    return saves
