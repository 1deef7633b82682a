"""What the control callers (``kvstore.control.caller``) hand back: the nodes' answers
added up (``ControlReport``), and where a prefix lives, node by node and block by block
(``WhereReport``). Plain dataclasses: a caller prints them, or ``asdict``s them into
JSON (``kvstore pin --json``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.control.requests import BlockResidency, NodeAction

TIER_MEMORY = "CPU"
TIER_DISK = "DISK"


@dataclass
class ControlReport:
    """Every live node's answer to one pin, unpin, prefetch or clear, added up.

    ``pages``, ``bytes``, ``memory``, ``disk``, ``missing``: the sums of the nodes'
    ``NodeAction`` figures (a page held by two replicas counts twice: each node acted on
    its copy; ``missing`` counts, per node, the pages the prefix names that it does not
    hold). ``nodes``: each answering node's own figures, by node id. ``unreachable``:
    node id -> why its answer is not in the sums (no metrics port in its registry
    entry, connection refused, timed out, a 5xx); the action is incomplete there."""

    action: str
    pages: int = 0
    bytes: int = 0
    memory: int = 0
    disk: int = 0
    missing: int = 0
    nodes: list[NodeAction] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, action: str, nodes: list[NodeAction], unreachable: dict[str, str]) -> ControlReport:
        """The report of ``nodes``' answers (sorted by node id) with their sums."""
        ordered = sorted(nodes, key=lambda n: n.node_id)
        return cls(
            action=action,
            pages=sum(n.pages for n in ordered),
            bytes=sum(n.bytes for n in ordered),
            memory=sum(n.memory for n in ordered),
            disk=sum(n.disk for n in ordered),
            missing=sum(n.missing for n in ordered),
            nodes=ordered,
            unreachable=dict(sorted(unreachable.items())),
        )


@dataclass(frozen=True)
class BlockHolder:
    """One node's copy of one block (``WhereReport.holders``)."""

    node_id: str
    tier: str
    pinned: bool
    pin_ttl_s: float | None


@dataclass(frozen=True)
class NodeResidency:
    """One node's blocks of a prefix in one namespace, counted (a row of ``kvstore
    where``): ``memory`` every page in memory, ``disk`` some page only on disk,
    ``pinned`` every page pinned; ``shortest_ttl_s`` the least time a pin of these
    blocks has left (None: no pin of them expires)."""

    node_id: str
    namespace: str
    memory: int
    disk: int
    pinned: int
    shortest_ttl_s: float | None


@dataclass
class WhereReport:
    """Where a prefix's blocks lie: every live node's own table, as it answered the
    prefix query with ``residency``.

    ``residency``: node id -> namespace digest -> the blocks of the prefix that node
    holds (``BlockResidency``: block number, tier, pinned, pin TTL). ``stored``:
    namespace digest -> blocks of the prefix the index finds stored (the most any node
    answered). ``unreachable``: node id -> why its table is not here."""

    residency: dict[str, dict[str, list[BlockResidency]]] = field(default_factory=dict)
    stored: dict[str, int] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)

    def holders(self) -> dict[str, dict[int, list[BlockHolder]]]:
        """Namespace digest -> block -> the nodes holding it (by node id), merged from
        every node's table: which nodes hold which blocks."""
        out: dict[str, dict[int, list[BlockHolder]]] = {}
        for node_id, spaces in sorted(self.residency.items()):
            for digest, blocks in spaces.items():
                per_block = out.setdefault(digest, {})
                for b in blocks:
                    holder = BlockHolder(node_id, b.tier, b.pinned, b.pin_ttl_s)
                    per_block.setdefault(b.block, []).append(holder)
        return {d: dict(sorted(per_block.items())) for d, per_block in sorted(out.items())}

    def summary(self) -> list[NodeResidency]:
        """One row per node and namespace it holds blocks of (by node id, then digest)."""
        rows = []
        for node_id, spaces in sorted(self.residency.items()):
            for digest, blocks in sorted(spaces.items()):
                ttls = [b.pin_ttl_s for b in blocks if b.pinned and b.pin_ttl_s is not None]
                rows.append(
                    NodeResidency(
                        node_id=node_id,
                        namespace=digest,
                        memory=sum(b.tier == TIER_MEMORY for b in blocks),
                        disk=sum(b.tier != TIER_MEMORY for b in blocks),
                        pinned=sum(b.pinned for b in blocks),
                        shortest_ttl_s=min(ttls) if ttls else None,
                    )
                )
        return rows
