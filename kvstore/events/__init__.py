"""vLLM-format KV events: the wire format (``format``), a bounded ZMQ publisher for
storage nodes (``publisher``; what it is told and counts: ``options``; the batches it
hands again to a router that missed them: ``replay``), which router a stream is shaped
for (``profiles``), and on an authenticated stream who may read which events
(``access``) and the guard that enforces it on the publisher's thread (``gate``).
Routers that read a vLLM engine's KV events (llm-d, Dynamo) read these unchanged;
docs/router-integration.md says how to point them here."""

from kvstore.events.format import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    OWNERSHIP,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    block_removed,
    block_stored,
    decoder,
    pool_topic,
    tenant_prefix,
)
from kvstore.events.options import PublisherOptions, PublisherStats
from kvstore.events.profiles import PROFILES, EventProfile, u64_hash
from kvstore.events.publisher import EventPublisher
from kvstore.events.replay import END_SEQ

__all__ = [
    "END_SEQ",
    "LOCAL",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "OWNERSHIP",
    "PROFILES",
    "REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventProfile",
    "EventPublisher",
    "KVCacheEvent",
    "KVEventBatch",
    "PublisherOptions",
    "PublisherStats",
    "block_removed",
    "block_stored",
    "decoder",
    "pool_topic",
    "tenant_prefix",
    "u64_hash",
]
