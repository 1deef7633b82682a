"""vLLM's KV-event wire format, as msgspec structs kvstore can encode without vLLM.

Routers (llm-d's KV-cache manager, Dynamo's KV router) decode what a vLLM engine
publishes with vLLM's own types (``vllm/distributed/kv_events.py``, vLLM 0.32): a
``KVEventBatch`` encoded with ``msgspec.msgpack``. A storage node publishes the same
bytes, so the structs here repeat vLLM's exactly - class names (the union tags),
field names, field order, defaults and struct options:

- ``KVEventBatch``: ``array_like``, so a batch is the msgpack array ``[ts, events,
  data_parallel_rank]`` (the rank nil for a node; an array keeps every field, whatever
  ``omit_defaults`` says).
- The events: maps tagged by class name (``{"type": "BlockStored", ...}``),
  ``omit_defaults``, so the optional fields after ``lora_name`` are left out while
  they hold their default (None).

tests/kvstore/events/test_kv_events.py holds the golden check: each event encoded here is the same
bytes as the same event encoded with vLLM's classes, and decodes with vLLM's decoder.
A change to vLLM's structs must be mirrored here field for field."""

from __future__ import annotations

from typing import Any

import msgspec

# The ``medium`` values vLLM names (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE). A storage
# node's memory tier is host DRAM: "CPU" (llm-d's "cpu", Dynamo's host tier); its disk
# tier is MEDIUM_DISK below, not vLLM's "STORAGE", which older Dynamo revisions do not
# map (an unknown medium counts as a GPU block there).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# A storage node's disk tier: "DISK" is the name every Dynamo revision we read maps to
# its disk tier (weight 0.25; "STORAGE" only in later ones), and llm-d weighs it by an
# entry named "disk" (docs/router-integration.md).
MEDIUM_DISK = "DISK"
# ``locality`` values (vLLM's ``Locality``): where the blocks live relative to the
# process that publishes the event.
LOCAL = "LOCAL"
REMOTE = "REMOTE"
# ``ownership`` of the blocks kvstore announces (vLLM: "secondary offloading tier
# identifier"): tells a consumer these blocks are in kvstore, not in an engine's own
# CPU offloading tier, which also publishes medium "CPU".
OWNERSHIP = "kvstore"

# vLLM's ExternalBlockHash: a block hash is bytes (sha256-based hashing, the default),
# or an int when the engine sets VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
BlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: when it was made, its events in order, and
    the engine's data-parallel rank (None for a storage node)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; each is tagged by its class name."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (in prefix order, the first one's parent being
    ``parent_block_hash``) now hold ``token_ids`` (``block_size`` per block) in
    ``medium``. ``lora_id`` is deprecated in vLLM (kept for old consumers);
    ``extra_keys`` has one entry per block, as vLLM publishes them untagged."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks ``block_hashes`` are no longer held in ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block the publisher announced is gone (a node restarted without its disk)."""


class KVEventBatch(EventBatch):
    """``EventBatch`` whose events decode as the three kinds (what subscribers decode)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_stored(
    block_hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    *,
    parent_block_hash: BlockHash | None = None,
    medium: str = MEDIUM_CPU,
    lora_name: str | None = None,
    lora_id: int | None = None,
    extra_keys: list[tuple[Any, ...] | None] | None = None,
    locality: str | None = None,
    ownership: str | None = OWNERSHIP,
) -> BlockStored:
    """A ``BlockStored`` of whole blocks: ``token_ids`` must be ``block_size`` tokens per
    hash (routers re-hash the tokens block by block; a short or long list would name
    other blocks). Raises ValueError otherwise. Called by a storage node per put."""
    if block_size <= 0 or len(token_ids) != len(block_hashes) * block_size:
        raise ValueError(
            f"{len(block_hashes)} blocks of {block_size} tokens need "
            f"{len(block_hashes) * block_size} token ids, got {len(token_ids)}"
        )
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
        locality=locality,
        ownership=ownership,
    )


def block_removed(
    block_hashes: list[BlockHash],
    *,
    medium: str = MEDIUM_CPU,
    locality: str | None = None,
    ownership: str | None = OWNERSHIP,
) -> BlockRemoved:
    """A ``BlockRemoved`` of ``block_hashes`` from ``medium`` (a demotion is this from
    "CPU" followed by a ``block_stored`` in "STORAGE")."""
    return BlockRemoved(
        block_hashes=block_hashes, medium=medium, locality=locality, ownership=ownership
    )


def pool_topic(store_id: str, model: str, tenant: str | None = None) -> str:
    """The topic a storage node publishes under: ``kv@pool:<store id>:<tenant>@<model>``,
    the form of llm-d's shared-pool proposal (an engine's is ``kv@<pod>@<model>``) with
    the tenant in the holder's name, so each tenant's blocks have topics of their own
    (``tenant_prefix``); without ``tenant``, ``kv@pool:<store id>@<model>``. ``store_id``
    names the store (every node of one store uses the same id); no part may contain
    "@", which separates them."""
    for name, value in (("store id", store_id), ("model", model)):
        if not value or "@" in value:
            raise ValueError(f"{name} must be non-empty and contain no '@': {value!r}")
    if tenant is None:
        return f"kv@pool:{store_id}@{model}"
    return f"{tenant_prefix(store_id, tenant)}{model}"


def tenant_prefix(store_id: str, tenant: str) -> str:
    """What every topic of ``tenant``'s blocks starts with, and no other topic does
    (tenant names hold neither ":" nor "@"): what a router that reads the tenant is
    subscribed to."""
    return f"kv@pool:{store_id}:{tenant}@"


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of payloads into ``KVEventBatch`` (tests and tools; routers use vLLM's)."""
    return msgspec.msgpack.Decoder(KVEventBatch)
