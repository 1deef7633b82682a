"""Counters a client keeps about its own traffic (``client.stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ClientStats:
    lookups: int = 0
    # get_found calls that asked the index again: the find was past half its lease
    stale_finds: int = 0
    pages_sent: int = 0
    pages_skipped: int = 0
    pages_refused: int = 0
    bytes_sent: int = 0
    pages_received: int = 0
    bytes_received: int = 0
    checksum_failures: int = 0
    node_errors: int = 0
    # of those, calls a node did not answer within their time limit: slow, stalled or
    # cut off by the network, not known to be down (the rest: refused, closed, gone)
    node_timeouts: int = 0
    # nodes that left the registry while this client used them: their heartbeats
    # stopped reaching the index (dead, or cut off from it)
    nodes_left: int = 0
    # requests a node refused for this client's token (CredentialError when every node asked did)
    credential_refusals: int = 0
    index_errors: int = 0
    # of those, calls the index did not answer within their time limit (a lookup's
    # budget, say): slow or loaded, not known to be down
    index_timeouts: int = 0
    index_script_errors: int = 0
    direct_transfers: int = 0
    staged_transfers: int = 0
    # requests that moved pages through shared memory (kvstore.wire.shm)
    same_host_transfers: int = 0
    # requests whose pages were copied from a node's memory straight into device memory
    # (client.memory.device_pages: DMA from registered mappings, checked on the device)
    device_transfers: int = 0
    # node slabs registered with CUDA for those copies, and registrations that failed
    # (pages of such a slab are copied at pageable speed; logged once)
    host_registrations: int = 0
    host_register_failures: int = 0
    # pages of such gets read straight from their index slots, without the node's plan
    # (client.nodes.slot_reads), and of those the ones whose check failed (moved or
    # evicted since the index recorded them; asked for again through a plan)
    slot_reads: int = 0
    slot_read_misses: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
