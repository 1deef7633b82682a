"""Fetch rounds: pages into the caller's memory from their replicas, each verified by
checksum (``ReplicaFetcher``), and the requests that name this rank's units of
blocks (``unit_requests``)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import numpy as np

from client.memory.buffers import Span
from client.memory.device_rows import DeviceRows
from client.nodes.calls import Expected, NodeRefusedError
from client.nodes.credentials import CallRefusals
from client.nodes.directory import NodeDirectory
from client.stats import ClientStats
from kvstore.errors import RemoteFault
from kvstore.index import LookupResult, NodeInfo, PageLocation
from kvstore.index.records import SoleReplicas
from kvstore.pages import heads
from kvstore.pages.heads import RankUnits
from kvstore.pages.keys import NamespaceKey


class ReplicaFetcher:
    """One job: fetch pages into sinks from their replicas and say which arrived intact.
    Each round asks every missing page's preferred untried replica, all nodes at once,
    until every page arrived or its replicas ran out, within the client's ``timeout``
    overall. A node that fails is suspected and its pages stay missing (a miss, never
    wrong bytes); a call that every node asked refused for the client's token raises
    ``CredentialError`` (``client.nodes.credentials``). Runs on the client's event loop."""

    def __init__(
        self, nodes: NodeDirectory, stats: ClientStats, namespace: NamespaceKey, timeout: float
    ) -> None:
        self._nodes = nodes
        self._stats = stats
        self._namespace = namespace
        self._timeout = timeout

    async def fetch(
        self,
        hashes: list[bytes],
        locations: list[list[PageLocation]] | SoleReplicas,
        sinks: list[Span] | DeviceRows,
    ) -> list[bool]:
        """Fetch page i of ``hashes`` from its replicas ``locations[i]`` into ``sinks[i]``;
        per page, whether it arrived intact."""
        deadline = time.monotonic() + self._timeout
        ok = np.zeros(len(hashes), dtype=bool)
        nodes = {n.node_id: n for n in await self._nodes.live()}
        asked: set[str] = set()
        refusals = CallRefusals(self._stats, self._namespace.tenant, "read")
        if isinstance(locations, SoleReplicas):  # one round: no other replica to try
            if deadline - time.monotonic() <= 0:  # the live nodes took the whole time
                return ok.tolist()
            sole: dict[str, np.ndarray] = {}
            for number in np.unique(locations.numbers).tolist():
                node_id = locations.nodes[number].node_id
                if node_id in nodes:
                    sole[node_id] = np.flatnonzero(locations.numbers == number)
            asked.update(sole)
            await asyncio.gather(
                *(
                    self._get_on(
                        nodes[n],
                        idx,
                        locations.checksums[idx],
                        hashes,
                        sinks,
                        ok,
                        deadline - time.monotonic(),
                        refusals,
                        locations.slots[idx],
                    )
                    for n, idx in sole.items()
                )
            )
            refusals.raise_if_all(asked)
            return ok.tolist()
        tried: list[set[str]] = [set() for _ in hashes]
        for _ in range(max((len(loc) for loc in locations[: len(hashes)]), default=0)):
            per_node = self._next_round(hashes, locations, ok, tried, nodes)
            remaining = deadline - time.monotonic()
            if not per_node or remaining <= 0:
                break
            asked.update(per_node)
            calls = []
            for n, idx in per_node.items():
                placed = [next(loc for loc in locations[i] if loc.node_id == n) for i in idx]
                calls.append(
                    self._get_on(
                        nodes[n],
                        np.asarray(idx, dtype=np.int64),
                        [loc.checksum for loc in placed],
                        hashes,
                        sinks,
                        ok,
                        remaining,
                        refusals,
                        np.array([loc.slot for loc in placed], dtype=np.uint64),
                    )
                )
            await asyncio.gather(*calls)
            if ok.all():
                break
        refusals.raise_if_all(asked)
        return ok.tolist()

    def _next_round(
        self,
        hashes: list[bytes],
        locations: list[list[PageLocation]],
        ok: np.ndarray,
        tried: list[set[str]],
        nodes: dict[str, NodeInfo],
    ) -> dict[str, list[int]]:
        """Per node, the pages still missing whose preferred untried replica it holds."""
        per_node: dict[str, list[int]] = defaultdict(list)
        arrived = ok.tolist()
        for i, locs in enumerate(locations[: len(hashes)]):
            if arrived[i]:
                continue
            if len(locs) == 1:  # one replica: nothing to order (a 1,024-page get: 2.5 ms less)
                only = locs[0]
                if only.node_id not in tried[i] and only.node_id in nodes:
                    tried[i].add(only.node_id)
                    per_node[only.node_id].append(i)
                continue
            choice = next(
                (
                    loc
                    for loc in self._nodes.prefer(hashes[i], locs)
                    if loc.node_id not in tried[i] and loc.node_id in nodes
                ),
                None,
            )
            if choice is not None:
                tried[i].add(choice.node_id)
                per_node[choice.node_id].append(i)
        return per_node

    async def _get_on(
        self,
        node: NodeInfo,
        idx: np.ndarray,
        expected: Expected,
        hashes: list[bytes],
        sinks: list[Span] | DeviceRows,
        ok: np.ndarray,
        seconds: float,
        refusals: CallRefusals,
        slots: np.ndarray,
    ) -> None:
        """Get pages ``idx`` from ``node`` into their sinks, marking in ``ok`` those that
        arrived intact (``expected`` and ``slots``: their checksums and pool slots in
        the index, in ``idx``'s order); a node that fails is suspected, its pages stay
        missing."""
        whole = len(idx) == len(hashes)  # every page, in order: no lists to pick
        if whole:
            picked = sinks
        elif isinstance(sinks, DeviceRows):
            picked = sinks.take(idx)
        else:
            picked = [sinks[i] for i in idx.tolist()]
        try:
            got, conn = await self._nodes.on_node(
                node,
                lambda c: c.get(
                    self._namespace,
                    hashes if whole else [hashes[i] for i in idx.tolist()],
                    picked,
                    expected,
                    seconds,
                    slots=slots,
                ),
            )
        except NodeRefusedError as exc:
            if exc.credentials:
                refusals.add_refusal(exc)
            else:
                self._nodes.failed(node.node_id, exc)
            return
        except RemoteFault as exc:
            self._nodes.failed(node.node_id, exc)
            return
        self._nodes.ok(node.node_id)
        arrived = idx[got.ok]
        ok[arrived] = True
        self._stats.pages_received += len(arrived)
        if isinstance(sinks, DeviceRows):
            self._stats.bytes_received += len(arrived) * sinks.nbytes
        else:
            self._stats.bytes_received += sum(sinks[i].nbytes for i in arrived.tolist())
        self._stats.checksum_failures += got.corrupt
        if conn.path == "shm":
            self._stats.same_host_transfers += 1


def unit_requests(
    rank: RankUnits, hashes: list[bytes], result: LookupResult, blocks: slice
) -> tuple[list[bytes], list[list[PageLocation]] | SoleReplicas]:
    """The keys and replicas of ``rank``'s units of ``blocks``, unit by unit
    (``heads.unit_hashes``): as arrays when each has one replica."""
    count = rank.count
    if count == 1 and (sole := result.sole(blocks)) is not None:
        return heads.unit_hashes(hashes[blocks], rank.first, count), sole
    return unit_locations(rank, hashes, result, blocks)


def unit_locations(
    rank: RankUnits, hashes: list[bytes], result: LookupResult, blocks: slice
) -> tuple[list[bytes], list[list[PageLocation]]]:
    """``unit_requests`` with every replica listed (for callers that join lists)."""
    count, first = rank.count, rank.first
    keys_ = heads.unit_hashes(hashes[blocks], first, count)
    if count == 1:
        return keys_, result.locations[blocks]
    locations = [
        [loc for loc in locs if loc.unit == j]
        for j in range(count)
        for locs in result.locations[blocks]
    ]
    return keys_, locations


def leading(ok: list[bool]) -> int:
    """How many leading requests arrived intact."""
    return ok.index(False) if False in ok else len(ok)


def whole_blocks(ok: list[bool], count: int, blocks: int) -> int:
    """How many leading blocks arrived whole: every one of their ``count`` units, which
    ``ok`` lists unit by unit (``heads.unit_hashes``)."""
    whole = np.array(ok[: count * blocks], dtype=bool).reshape(count, blocks).all(axis=0)
    return blocks if whole.all() else int(np.argmin(whole))
