"""Reading pages straight from the slots the index places them in (``slot_part``),
on the same host, without asking the node for a plan first.

A same-host client maps the slabs of its tenant that nodes lend it and keeps them
(``client.nodes.shm_connection``). The index records each page's pool slot (a byte
offset into the node's pool; ``docs/key-format.md``), and a node that advertises
``slab_bytes`` says how the pool divides into slabs, so the client can find the page in
a slab it mapped and copy it at once. Nothing is pinned: the slot may have been reused
since the index recorded it, or be overwritten during the copy. What makes that safe is
the check the planned path makes anyway: the bytes that *landed* are hashed and must
equal the index's checksum, so a moved, evicted or torn page is a miss (asked for again
through a plan), never wrong KV; a slab another tenant took reads zeros in the old
mapping (server/pool.py). The node is told afterwards (``SlotReads``), so its counters
and eviction order see the read.

Why: on an H200 host (``bench/gpu_check.py`` section 6) a 256 MiB device get's copies
started about 1.6 ms after the call, a round trip to the node and its plan, against
5 ms of copies; the goal of 0.8x the bus left 1.1 ms for everything but them."""

from __future__ import annotations

import numpy as np

from client.nodes.calls import Expected
from client.nodes.get_plan import PlanPart
from kvstore.index import NodeInfo


def slab_bytes(node: NodeInfo) -> int:
    """The node's slab size as its registry entry gives it; 0 when it gives none (an
    older node, or one without the same-host path): no slot reads there."""
    raw = node.extra.get("slab_bytes", "")
    return int(raw) if raw.isdigit() else 0


def slot_part(
    node: NodeInfo,
    slots: np.ndarray,
    expected: Expected,
    maps: dict[int, np.ndarray],
    nbytes: int,
) -> PlanPart | None:
    """The pages of a get (``slots`` and ``expected``: the index's slots and checksums,
    by request position) that lie in slabs this connection mapped (``maps``), within
    them, as a plan part of their own; None when there is none (the node gives no slab
    size, or none of the pages lies in a mapped slab)."""
    slab = slab_bytes(node)
    if slab <= 0 or not len(slots) or not maps:
        return None
    slots = np.asarray(slots, dtype=np.uint64)
    regions = slots // np.uint64(slab)
    offsets = (slots - regions * np.uint64(slab)).astype(np.int64)
    slabs, index = np.unique(regions, return_inverse=True)
    index = index.reshape(-1)
    limits = np.array([getattr(maps.get(r), "size", 0) for r in slabs.tolist()], dtype=np.int64)
    keep = offsets + nbytes <= limits[index]  # in a mapped slab (else its limit is 0), within it
    present = np.flatnonzero(keep)
    if not len(present):
        return None
    sums = np.asarray(expected, dtype=np.uint64)
    if len(present) < len(slots):
        sums, regions, offsets, index = sums[keep], regions[keep], offsets[keep], index[keep]
    sizes = np.full(len(present), nbytes, dtype=np.uint64)
    return PlanPart(present, sizes, sums, regions, offsets, slabs, index)
