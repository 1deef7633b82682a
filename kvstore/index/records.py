"""What the page index holds and answers, as plain data: the 48-byte segment entry,
page locations, node registrations, lookup results and their liveness check, stats.

``kvstore.index.page_index`` reads and writes these in Redis/Valkey; clients and
nodes use them without knowing how they are stored (docs/key-format.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.index import _match
from kvstore.pages.namespace import Namespace

# One entry of a segment: a page held by a node; 48 bytes, little-endian
# (docs/key-format.md). The page hash is read as two u64 so numpy can compare it.
ENTRY = np.dtype(
    [
        ("h0", "<u8"),
        ("h1", "<u8"),
        ("node", "<u4"),
        ("pos", "<u2"),
        ("flags", "<u2"),
        ("size", "<u4"),
        ("tag", "<u4"),
        ("slot", "<u8"),
        ("checksum", "<u8"),
    ]
)
HASH_PAIR = np.dtype([("h0", "<u8"), ("h1", "<u8")])
# ENTRY as plain 48-byte items, to select and join records: numpy copies a structured
# dtype field by field (measured: selecting 8,192 records by a mask 345 us, joining two
# halves 373 us; as plain items 24 us and a few us).
RAW_ENTRY = np.dtype((np.void, ENTRY.itemsize))


def select_records(records: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``records[mask]`` for ENTRY records, copied as plain items."""
    return records.view(RAW_ENTRY)[mask].view(ENTRY)


def incarnation_tag(incarnation: str) -> int:
    """32 of an incarnation's random bits, which its entries carry: enough to tell the
    incarnations of one node number apart (a clash could only point a reader at a node
    that then has no such page, never at wrong bytes: the node checks hash and checksum)."""
    return int(incarnation[-8:], 16)


@dataclass(frozen=True, slots=True)
class PageLocation:
    """Where one replica of a page lives: node id and incarnation, pool slot, size, checksum."""

    node_id: str
    incarnation: str
    slot: int
    size: int
    checksum: int
    unit: int = 0  # which head group of its block (kvstore.pages.heads); 0 for whole pages


@dataclass(frozen=True, slots=True)
class SoleReplicas:
    """Pages with one replica each, as arrays: page ``i``'s is on node
    ``nodes[numbers[i]]``, with checksum ``checksums[i]``, in pool slot ``slots[i]``
    (``LookupResult.sole``)."""

    numbers: np.ndarray
    checksums: np.ndarray
    nodes: dict[int, NodeInfo]
    slots: np.ndarray

    def __len__(self) -> int:
        return len(self.numbers)


@dataclass(frozen=True, slots=True)
class CommitEntry:
    """A verified page to publish; ``anchor`` and ``position`` place it in its segment
    (``kvstore.pages.keys.placement``)."""

    page_hash: bytes
    anchor: bytes
    position: int
    slot: int
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A registered storage node as stored in the registry."""

    node_id: str
    address: str
    capacity: int
    incarnation: str
    number: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def tag(self) -> int:
        return incarnation_tag(self.incarnation)

    @property
    def pages(self) -> dict[str, int]:
        """Pages this node reports holding, per namespace digest (its heartbeat)."""
        try:
            return {str(k): int(v) for k, v in json.loads(self.extra.get("pages", "{}")).items()}
        except (ValueError, AttributeError):
            return {}


@dataclass(frozen=True, slots=True)
class Registration:
    """What ``register_node`` grants: the incarnation and the node id's number."""

    incarnation: str
    number: int


class LookupResult:
    """``matched`` leading pages have a live replica; ``locations[i]`` lists page i's.

    ``locations`` is built on first use: a scheduler that only asks how long the prefix
    is never pays for thousands of small objects."""

    __slots__ = ("_locations", "_nodes", "_positions", "_records", "_units", "matched")

    def __init__(
        self,
        matched: int,
        records: np.ndarray,
        positions: np.ndarray,
        units: np.ndarray,
        nodes: dict[int, NodeInfo],
    ) -> None:
        self.matched = matched
        self._records = records
        self._positions = positions
        self._units = units
        self._nodes = nodes
        self._locations: list[list[PageLocation]] | None = None

    @property
    def locations(self) -> list[list[PageLocation]]:
        """Per position, every live replica of every unit asked there."""
        if self._locations is None:
            out: list[list[PageLocation]] = [[] for _ in range(self.matched)]
            recs = self._records
            for number, slot, size, checksum, pos, unit in zip(
                recs["node"].tolist(),
                recs["slot"].tolist(),
                recs["size"].tolist(),
                recs["checksum"].tolist(),
                self._positions.tolist(),
                self._units.tolist(),
            ):
                node = self._nodes[number]
                out[pos].append(
                    PageLocation(node.node_id, node.incarnation, slot, size, checksum, unit)
                )
            self._locations = out
        return self._locations

    def sole(self, blocks: slice) -> SoleReplicas | None:
        """The replicas of positions ``blocks`` as arrays when every matched position
        has exactly one (one replica per page, whole pages: a reader's common case,
        which then never builds ``locations``); None otherwise."""
        recs, positions = self._records, self._positions
        if len(recs) != self.matched or self._units.any():
            return None
        if not np.array_equal(positions, np.arange(self.matched)):
            return None
        return SoleReplicas(
            recs["node"][blocks],
            recs["checksum"][blocks].astype(np.uint64),
            self._nodes,
            recs["slot"][blocks].astype(np.uint64),
        )

    @classmethod
    def empty(cls) -> LookupResult:
        """No stored prefix."""
        none = np.zeros(0, dtype=np.int64)
        return cls(0, np.zeros(0, dtype=ENTRY), none, none, {})

    def narrow(self, first: int, count: int) -> LookupResult:
        """The replicas of units ``first`` to ``first + count - 1`` only, numbered from 0:
        what a reader of those head groups needs of a lookup made for all of them (the
        vLLM connector's workers, from their scheduler's lookup). ``matched`` holds, as
        every unit of the matched blocks had a live replica."""
        if first == 0 and count >= int(self._units.max(initial=0)) + 1:
            return self
        keep = (self._units >= first) & (self._units < first + count)
        return LookupResult(
            self.matched,
            select_records(self._records, keep),
            self._positions[keep],
            self._units[keep] - first,
            self._nodes,
        )

    def head(self, blocks: int) -> LookupResult:
        """The first ``blocks`` positions only: what a caller loading a shorter prefix
        than was matched needs (the vLLM connector, when a draft model's pages end
        sooner than the target's)."""
        if blocks >= self.matched:
            return self
        keep = self._positions < blocks
        return LookupResult(
            max(blocks, 0),
            select_records(self._records, keep),
            self._positions[keep],
            self._units[keep],
            self._nodes,
        )

    def __getstate__(self) -> tuple:
        # sent to other processes (the vLLM connector's step metadata): without the
        # locations, which are rebuilt there on first use
        return self.matched, self._records, self._positions, self._units, self._nodes

    def __setstate__(self, state: tuple) -> None:
        LookupResult.__init__(self, *state)


@dataclass(frozen=True, slots=True)
class IndexLookup:
    """What the index holds for the leading hashes of a lookup, before liveness: the
    segments read cover the first ``covered`` positions; ``records[i]`` (``ENTRY``) is
    an entry for the page at ``positions[i]``. ``unavailable`` holds the error of a
    shard that could not answer (its segments counted as absent), else None."""

    covered: int
    records: np.ndarray
    positions: np.ndarray
    units: np.ndarray  # each record's unit, counted from the first unit asked at its position
    # units asked per position (1 for whole pages), ``covered`` long, or one number for all
    need: np.ndarray | int
    unavailable: KVStoreError | None = None

    def resolve(self, nodes: Sequence[NodeInfo], *, last: bool = False) -> LookupResult:
        """Keep the records of the registry's current incarnations; the prefix ends at the
        first position lacking a live record of some unit asked there. One pass in C
        (``_match.resolve``; numpy's 12 calls took 0.07 ms of a first lookup after a
        pause). ``last``: a chain whose pages are stored at some positions only (a hybrid
        model's boundary states, client.vllm.states): the prefix ends after the last
        position with a live record of every unit, and only that position's records are
        kept."""
        live = {n.number: n for n in nodes}
        matched, recs, positions, units = _match.resolve(
            self.records,
            self.positions,
            self.units,
            live_tags(live),
            self.covered,
            *self._need(),
            last,
        )
        return LookupResult(matched, *entry_arrays(recs, positions, units), live)

    def present(self, nodes: Sequence[NodeInfo]) -> np.ndarray:
        """Per position covered, whether every unit asked there has a live record
        (the registry's current incarnation of its node): a sparse lookup's answer
        position by position (SGLang's side pools, whose pages some positions hold)."""
        live = {n.number: n for n in nodes}
        has = _match.present(
            self.records, self.positions, self.units, live_tags(live), self.covered, *self._need()
        )
        return np.frombuffer(has, dtype=bool)

    def _need(self) -> tuple[int, np.ndarray | None]:
        """``need`` as ``_match`` takes it: one number for all positions, or per position."""
        need = self.need
        if isinstance(need, int):
            return need, None
        return 1, np.ascontiguousarray(need, dtype=np.int64)


def entry_arrays(
    recs: bytearray, positions: bytearray, units: bytearray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``_match`` hands back as arrays, without a copy: ENTRY records, and their
    positions and units (int64)."""
    return (
        np.frombuffer(recs, dtype=ENTRY),
        np.frombuffer(positions, dtype=np.int64),
        np.frombuffer(units, dtype=np.int64),
    )


def live_records(records: np.ndarray, live: dict[int, NodeInfo]) -> np.ndarray:
    """Per ENTRY record, whether it is of the live incarnation of its node (``live``: by
    node number), as ``IndexLookup.resolve`` counts it."""
    return np.frombuffer(_match.live(records, live_tags(live)), dtype=bool)


def live_tags(live: dict[int, NodeInfo]) -> list[int]:
    """Per node number, the tag of its live incarnation (``incarnation_tag``), -1 where
    no live node has that number: what ``_match`` checks records against."""
    tags = [-1] * (max(live, default=-1) + 1)
    for number, info in live.items():
        tags[number] = info.tag
    return tags


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Pages of one namespace held by live nodes (each replica counts), per node id."""

    digest: str
    pages: int
    namespace: Namespace | None
    per_node: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class IndexStats:
    """What ``stats`` reads of an index: its live nodes and its namespaces' page counts."""

    nodes: list[NodeInfo]
    namespaces: list[NamespaceStats]
