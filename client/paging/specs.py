"""What a connector's scheduler side hands its workers each step, engine-neutral: the
loads (``LoadSpec``), saves (``SaveSpec``) and hybrid gathers (``GatherSpec``). The vLLM
connector carries them in ``client.vllm.metadata.KVStoreConnectorMetadata``."""

from __future__ import annotations

from dataclasses import dataclass, field

from client.lookups.stored_prefix import StoredPrefix
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
    # Hybrid KV-cache groups (client.vllm.support.hybrid_groups): each group's block ids
    # of the same positions (``block_ids`` is group 0's); a sliding group's ids below its
    # window are the null block 0, whose positions that group's layers do not load.
    group_block_ids: list[list[int]] = field(default_factory=list)
    # The draft's pages of the same blocks (client.vllm.drafts), found with the target's.
    draft_found: StoredPrefix | None = None
    # Loaded during this step's forward, layer by layer (client.paging.layerwise), not
    # before the request is scheduled again.
    layerwise: bool = False
    # A hybrid state-space model's state at the hit's last boundary (found with
    # ``last``), loaded into ``state_block_ids`` (one block per state group).
    state_found: StoredPrefix | None = None
    state_block_ids: list[int] = field(default_factory=list)


@dataclass
class AwaitedLoad:
    """Fill ``block_ids[start_block:]`` with the first ``len(block_ids)`` full blocks of
    ``tokens`` under ``extras``, which another engine announced it is saving (a P/D
    handoff: ``client.vllm.transfer_params``): the pages may not be stored yet. A worker
    waits for them at most ``wait_s`` (``client.paging.awaiting``), then loads what is
    stored; the rest is recomputed."""

    req_id: str
    tokens: list[int]
    extras: BlockExtras
    block_ids: list[int]
    start_block: int
    wait_s: float

    def ids_from(self, position: int) -> list[int]:
        """The block ids it fills from ``position`` on (never the null block 0)."""
        return [b for b in self.block_ids[max(position, self.start_block) :] if b]

    def load(self, found: StoredPrefix) -> LoadSpec:
        """The load of what ``found`` holds of it: its first ``found.blocks`` blocks."""
        return LoadSpec(self.req_id, found, self.block_ids[: found.blocks], self.start_block)


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
    # Hybrid groups: the pages were gathered step by step (``GatherSpec``), and
    # ``block_ids`` is empty; the worker publishes what it gathered, as the blocks from
    # ``start_block`` on.
    gathered: bool = False
    start_block: int = 0


@dataclass
class GatherSpec:
    """Hybrid groups: copy the blocks that became full this step out of the cache now,
    before vLLM frees a sliding group's blocks that left the window (it does so when it
    next schedules the request, and may hand them to another request). Position
    ``first + i`` of the request's ``blocks`` pages is block ``group_block_ids[g][i]`` of
    each group g's layers (never the null block: the scheduler stops gathering a request
    at a position it lacks in some group). The request's pages hold blocks ``base`` to
    ``blocks - 1``: after a hit, the blocks it loaded (and a sliding group's null blocks
    below its window) are not gathered."""

    req_id: str
    first: int
    blocks: int
    group_block_ids: list[list[int]]
    base: int = 0
