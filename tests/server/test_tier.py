"""The seam between a node's memory and the tier below it (server/tier.py).

A node's page handling is built here in-process, over the session's real Valkey index,
the way server/node.py wires it: once with ``NoTier`` (no disk) and once with the disk
tier in a temporary directory. Pages are put as a PUT stores them (claim, slots from
the evictor, bytes, commit, ready), more than the pool holds, so memory must evict;
what the tier was told then shows in the page table and the index."""

from __future__ import annotations

import ast
import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore import block_hashes
from kvstore.index import AsyncPageIndex, PageIndex
from kvstore.pages import keys
from kvstore.pages.checksum import checksums
from kvstore.pages.namespace import Namespace
from server.dataplane.readthrough import ReadThrough
from server.disk.demoter import TierPolicy
from server.disk.layout import HEADER_BYTES
from server.disk.tier import DiskTier, open_disk_tier
from server.eviction import Evictor
from server.identity import NodeIdentity
from server.metrics import NodeMetrics
from server.page import commit_entry
from server.pool import MemoryPool
from server.retire import Retirer
from server.store import PageStore
from server.tier import NoTier, Tier
from tests.support.helpers import namespace_for_page_size, page_bytes, tenant_for
from tests.support.paths import ROOT

PAGE = 64 << 10
SLAB = 1 << 20
POOL = 2 * SLAB  # 32 pages
PAGES = 48  # half as many again as the pool holds


@dataclass
class Parts:
    """A node's page handling, wired as server/node.py wires it."""

    store: PageStore
    index: AsyncPageIndex
    identity: NodeIdentity
    metrics: NodeMetrics
    tier: Tier
    evictor: Evictor
    readthrough: ReadThrough

    async def put(self, ns: Namespace, hashes: list[bytes]) -> None:
        """Store ``hashes`` one put each, as ``PutHandler`` does (without a connection)."""
        anchors, positions = keys.placement(hashes)
        for h, anchor, position in zip(hashes, anchors, positions):
            page = self.store.claim(
                (ns.digest_hex, h),
                ns.page_nbytes,
                owner=ns.tenant,
                anchor=anchor,
                position=position,
            )
            await self.evictor.allocate([page])
            assert page.offset is not None, "a put of one page always finds a slot"
            view = self.store.view(page)
            view[:] = page_bytes(ns, h)
            page.checksum = checksums([view])[0]
            assert all(
                await self.index.commit(
                    ns, self.identity.number, self.identity.incarnation, [commit_entry(page)]
                )
            )
            self.store.finish_put(page)
            self.tier.committed([page])

    async def read(self, ns: Namespace, hashes: list[bytes]) -> dict[bytes, bytes]:
        """The bytes of each page a get would send, as ``GetHandler`` finds them."""
        pinned = [
            p
            for p in (self.store.pin_for_read((ns.digest_hex, h)) for h in hashes)
            if p is not None
        ]
        _present, pages = await self.readthrough.in_memory(list(range(len(pinned))), pinned)
        try:
            return {p.key[1]: self.store.view(p).tobytes() for p in pages}
        finally:
            for page in pages:
                self.store.unpin(page)


async def build(url: str, ns: Namespace, disk: Path | None) -> Parts:
    store = PageStore(MemoryPool(POOL, SLAB, hugepages=False))
    index = AsyncPageIndex(url)
    identity = NodeIdentity(f"seam-{ns.tenant}")
    metrics = NodeMetrics()
    retirer = Retirer(store, index, identity, metrics)
    tier: Tier = NoTier()
    if disk is not None:
        tier = open_disk_tier(
            str(disk), 16 << 20, SLAB, TierPolicy(), store, retirer, metrics, high=0.9, low=0.5
        )
        tier.start()
    evictor = Evictor(store, retirer, tier, metrics, high=0.9, low=0.5)
    await index.ensure_namespace(ns)
    registration = await index.register_node(identity.node_id, "127.0.0.1:1", POOL, 60_000)
    identity.incarnation, identity.number = registration.incarnation, registration.number
    return Parts(
        store, index, identity, metrics, tier, evictor, ReadThrough(store, evictor, tier, metrics)
    )


async def close(parts: Parts) -> None:
    await parts.tier.stop()
    await parts.index.deregister_node(parts.identity.node_id, parts.identity.incarnation)
    await parts.index.close()


def indexed(url: str, ns: Namespace, hashes: list[bytes]) -> int:
    """How long a prefix of ``hashes`` the index finds on live nodes."""
    index = PageIndex(url)
    try:
        return index.lookup(ns, hashes).resolve(index.live_nodes()).matched
    finally:
        index.close()


@pytest.fixture()
def ns(request) -> Namespace:
    return namespace_for_page_size(PAGE, tenant=tenant_for(request.node.name))


def test_without_a_tier_evicted_pages_leave_the_table_and_the_index(valkey, ns):
    hashes = block_hashes(ns, list(range(PAGES * ns.block_size)))

    async def main() -> None:
        parts = await build(valkey.url, ns, None)
        try:
            await parts.put(ns, hashes)
            held = [h for h in hashes if parts.store.find_page((ns.digest_hex, h)) is not None]
            assert 0 < len(held) <= POOL // PAGE
            assert held == hashes[-len(held) :]  # the least recently used went
            assert parts.metrics.registry.get_sample_value(
                "kvstore_evicted_pages_total"
            ) == PAGES - len(held)
            assert parts.store.disk_pages == 0 and all(
                parts.store.find_page((ns.digest_hex, h)).offset is not None for h in held
            )
            assert indexed(valkey.url, ns, hashes) == 0  # block 0 left the index with its page
            assert await parts.read(ns, hashes) == {h: page_bytes(ns, h).tobytes() for h in held}
        finally:
            await close(parts)

    asyncio.run(main())


def test_with_the_disk_tier_evicted_pages_stay_ready_on_disk_and_come_back(valkey, ns, tmp_path):
    hashes = block_hashes(ns, list(range(PAGES * ns.block_size)))

    async def main() -> None:
        parts = await build(valkey.url, ns, tmp_path)
        try:
            await parts.put(ns, hashes)
            pages = [parts.store.find_page((ns.digest_hex, h)) for h in hashes]
            assert all(p is not None for p in pages), (
                "before_evict wrote every victim first: none was dropped"
            )
            disk_only = [p.key[1] for p in pages if p.offset is None]
            assert len(disk_only) >= PAGES - POOL // PAGE and all(
                p.disk is not None for p in pages if p.offset is None
            )
            assert parts.metrics.registry.get_sample_value("kvstore_evicted_pages_total") == 0
            assert (
                indexed(valkey.url, ns, hashes) == PAGES
            )  # the index does not follow pages between tiers
            for start in range(
                0, len(disk_only), 8
            ):  # a get's worth at a time: pinned pages hold their slots
                batch = disk_only[start : start + 8]
                assert await parts.read(ns, batch) == {
                    h: page_bytes(ns, h).tobytes() for h in batch
                }
            assert parts.metrics.registry.get_sample_value(
                "kvstore_tier_hit_pages_total", {"tier": "disk"}
            ) == len(disk_only)
        finally:
            await close(parts)

    asyncio.run(main())


def test_a_record_that_fails_its_check_is_a_miss_and_leaves_the_index(valkey, ns, tmp_path):
    hashes = block_hashes(ns, list(range(PAGES * ns.block_size)))

    async def main() -> None:
        parts = await build(valkey.url, ns, tmp_path)
        try:
            await parts.put(ns, hashes)
            victim = next(
                p
                for p in (parts.store.find_page((ns.digest_hex, h)) for h in hashes[1:])
                if p is not None and p.offset is None
            )
            assert victim.disk is not None
            position = hashes.index(victim.key[1])
            fd = os.open(tmp_path / "pages.dat", os.O_RDWR)
            try:
                byte = os.pread(fd, 1, victim.disk + HEADER_BYTES + 100)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), victim.disk + HEADER_BYTES + 100)
                os.fsync(fd)
            finally:
                os.close(fd)
            assert await parts.read(ns, [victim.key[1]]) == {}  # a miss, never wrong bytes
            assert parts.store.find_page(victim.key) is None
            assert (
                parts.metrics.registry.get_sample_value(
                    "kvstore_disk_errors_total", {"kind": "checksum"}
                )
                == 1
            )
            assert indexed(valkey.url, ns, hashes) == position
        finally:
            await close(parts)

    asyncio.run(main())


def test_no_tier_and_the_disk_tier_implement_every_call_of_the_seam():
    calls = [
        name for name, value in vars(Tier).items() if callable(value) and not name.startswith("_")
    ]
    assert {"before_evict", "demotable", "dropped", "committed", "load", "start", "stop"} <= set(
        calls
    )
    for tier in (NoTier, DiskTier):
        assert Tier in tier.__mro__  # named, so the seam shows as an import
        missing = [name for name in calls if getattr(tier, name) is getattr(Tier, name)]
        assert not missing, f"{tier.__name__} inherits the protocol's empty {missing}"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_memory_reaches_the_disk_only_through_the_tier_interface():
    """Calls between memory and disk are visible as imports: memory's side imports the
    interface, the disk tier imports the page table below it and never memory's side."""
    server = ROOT / "server"
    above = {
        "server.eviction",
        "server.dataplane",
        "server.node",
        "server.registry",
        "server.accept",
    }
    for path in sorted((server / "disk").glob("*.py")):
        climbs = {
            name
            for name in _imports(path)
            if any(name == a or name.startswith(a + ".") for a in above)
        }
        assert not climbs, f"{path.name} calls up into {climbs}"
    for name in ("store.py", "page.py", "tier.py", "retire.py"):
        assert not {
            i
            for i in _imports(server / name)
            if i.startswith(("server.disk", "server.eviction", "server.dataplane"))
        }, name
    memory = [server / "eviction.py", *sorted((server / "dataplane").glob("*.py"))]
    for path in memory:
        assert not {i for i in _imports(path) if i.startswith("server.disk")}, (
            f"{path.name} names the disk tier, not the interface"
        )
    assert "server.tier" in _imports(server / "eviction.py")


def test_the_disk_tier_changes_the_page_table_only_through_its_methods():
    """No assignment in server/disk/ reaches into another object: page and table state
    changes go through ``PageStore``'s methods."""
    for path in sorted((ROOT / "server" / "disk").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                    owner = leaf.value if isinstance(leaf, ast.Attribute) else None  # x.field = ...
                    if isinstance(leaf, ast.Subscript) and isinstance(leaf.value, ast.Attribute):
                        owner = (
                            leaf.value.value
                        )  # x.table[key] = ... (a local table is the code's own)
                    if owner is not None:
                        assert isinstance(owner, ast.Name) and owner.id == "self", (
                            f"{path.name}:{node.lineno} writes {ast.unparse(leaf)}"
                        )
