"""What the scheduler side hands the worker side each engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from client.async_client import StoredPrefix
from kvstore.pages.identity import NO_EXTRAS, BlockExtras


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
    """Publish the full blocks ``block_ids`` of ``token_ids`` under the request's
    identity ``extras`` (pages the store already holds are skipped by the storage
    nodes, so loaded blocks cost no transfer). ``event_id``: set when the engine
    publishes KV events; every worker answers it once (``client.vllm.events``)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    extras: BlockExtras = NO_EXTRAS
    event_id: int | None = None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: the engine only waits for transfers
