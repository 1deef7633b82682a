"""``ShmConnection``: one client's connection to a storage node on this host, over the
node's Unix socket, moving pages through shared memory (kvstore.wire.shm): one copy
between the node's slots and the caller's memory, hashed as it is copied."""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from client.memory.buffers import Span
from client.memory.copy_plans import PageCopies
from client.memory.device_landing import DeviceLanding
from client.memory.device_pages import DeviceCopier
from client.memory.device_rows import DeviceRows
from client.nodes.calls import (
    Checksums,
    Expected,
    GetOutcome,
    NodeClosedBeforeUseError,
    OutgoingPage,
    PutOutcome,
    SameHostUnavailableError,
    get_request,
    put_request,
    slot_reads,
)
from client.nodes.connection import Connection
from client.nodes.get_plan import PlanPart
from client.nodes.slab_maps import SlabMaps
from client.nodes.slot_reads import slot_part
from kvstore.errors import ProtocolError, TransportError
from kvstore.index import NodeInfo
from kvstore.pages.checksum import copy_checksummed
from kvstore.pages.keys import NamespaceKey
from kvstore.wire import protocol as P
from kvstore.wire import shm
from kvstore.wire.transport import with_timeout

# A device get's plan comes in parts of about this many bytes (``GetRequest.part_pages``):
# the first part's copies start while the node plans the rest. Measured on an H200 host
# (bench/gpu_check.py section 6, 256 MiB gets, three runs): 64 MiB parts against one
# plan 0.42-0.44x of the pinned copy against 0.27-0.33x for 64 KiB pages, and
# 0.62-0.67x against 0.62-0.69x for 2 MiB pages; smaller parts lost (32 MiB: 0.34-0.40x
# and 0.52-0.64x; 8 MiB: 0.16-0.23x), each part costing the client's loop about
# 0.8 ms of Python there, whatever its size.
PART_BYTES = 64 << 20
# Offsets and sizes in a plan at or past this are a broken node's, refused.
MAX_SLAB_BYTES = 1 << 48
_NOTHING = np.zeros(0, dtype=np.uint8)


class ShmConnection(Connection):
    """A node on this host, over its Unix socket and shared memory (kvstore.wire.shm)."""

    path = "shm"

    def __init__(self, node: NodeInfo, token: str, device: DeviceCopier | None = None) -> None:
        super().__init__(node, token, device)
        self._ch: shm.UnixChannel | None = None
        self._slabs = SlabMaps(node.node_id, device)
        self._maps = self._slabs.views
        # A connection dropped without close must not leave its mappings registered: once
        # unmapped, the range stays registered, and a later mapping at the same address
        # cannot be (seen on an H200 after a bench dropped a client unclosed:
        # cudaHostRegister refused a new slab mapping, error 712, already registered, and
        # that client's gets landed none of their pages). The finalizer runs before the
        # mappings are released.
        self._landing: list[DeviceLanding] = []  # the device get in flight's (one at a time)
        finalizer = weakref.finalize(self, self._slabs.release, self._landing)
        finalizer.atexit = False

    async def _open(self, timeout: float) -> None:
        if self._ch is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await with_timeout(
                    asyncio.get_running_loop().sock_connect(sock, self.node.extra["shm"]),
                    timeout,
                    f"connect to {self.node.node_id}",
                )
            except BaseException as exc:
                sock.close()
                if isinstance(exc, OSError):
                    raise SameHostUnavailableError(
                        f"cannot reach {self.node.node_id} on {self.node.extra['shm']}: {exc}"
                    ) from None
                raise
            self._ch = shm.UnixChannel(sock)

    def _channel(self) -> shm.UnixChannel:
        """The channel ``_open`` made; requests run only after it (``_guarded``)."""
        if self._ch is None:
            raise TransportError(f"connection to {self.node.node_id} is not open")
        return self._ch

    async def _ask(self, request: Any) -> None:
        """Send a request's first frame. A node that closed this connection before it
        (it restarted since, its socket path now another process's) never saw the
        request: ``NodeClosedBeforeUseError``, which the directory answers with one try
        on a new connection to the node's latest registry entry."""
        try:
            await self._channel().send_frame(request)
        except shm.PeerClosedError as exc:
            self.broken = True
            raise NodeClosedBeforeUseError(
                f"{self.node.node_id} closed the connection: {exc}"
            ) from None

    async def _recv_frame(self, expected: type) -> tuple[Any, list[int]]:
        raw, fds = await self._channel().recv_frame()
        try:
            return self._check_frame(P.decode(raw), expected), fds
        except BaseException:
            shm.close_fds(fds)
            raise

    async def _plan(self, kind: type) -> Any:
        """A same-host plan, mapping the slab descriptors that come with it (and with
        any earlier frames marked ``more``)."""
        while True:
            plan, fds = await self._recv_frame(kind)
            self._slabs.map(plan.mapped, fds)
            if not plan.more:
                return plan

    async def _put(
        self, namespace: NamespaceKey, pages: list[OutgoingPage], checksum: Checksums
    ) -> PutOutcome:
        await self._ask(
            put_request(namespace, self.token, pages, self.node.extra.get("put_tokens") == "1")
        )
        plan = await self._plan(P.PutPlan)
        wanted = self._check_put_plan(plan, len(pages))
        regions, offsets = plan.ints("regions"), plan.ints("offsets")
        if not len(regions) == len(offsets) == len(wanted):
            raise ProtocolError(f"node {self.node.node_id} sent a put plan without slots")
        copies = []
        for i, region, off in zip(wanted, regions, offsets):
            mapped = self._maps.get(region)
            size = pages[i].span.nbytes
            if mapped is None or not mapped.flags.writeable or off + size > mapped.size:
                raise ProtocolError(
                    f"node {self.node.node_id} lent a slot outside the slabs it mapped"
                )
            copies.append((mapped[off : off + size], pages[i].span.bytes()))
        # The one copy, straight into the node's slots; the checksums are of our own
        # bytes, so anything else written into a slot fails the node's verification.
        sums = np.array(copy_checksummed(copies, hash_source=True), dtype=np.uint64)
        await self._channel().send_frame(P.PutChecksums(checksums=sums))
        result, _ = await self._recv_frame(P.PutResult)
        return PutOutcome(
            result.ints("stored"),
            plan.ints("present"),
            plan.ints("refused"),
            sum(pages[i].span.nbytes for i in wanted),
        )

    async def _ask_get(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: Sequence[Span] | DeviceRows,
        probe: bool,
        part_pages: int = 0,
    ) -> None:
        """Send a get; ``part_pages`` asks for its plan in parts of that many pages, from
        a node that advertises ``get_parts`` (one plan from others)."""
        if self.node.extra.get("get_parts") != "1":
            part_pages = 0
        await self._ask(get_request(namespace, self.token, hashes, sinks, probe, part_pages))

    async def _plan_part(
        self, hashes: list[bytes], sinks: Sequence[Span] | DeviceRows, seen: np.ndarray
    ) -> tuple[PlanPart, bool]:
        """The next plan frame's pages the node holds and pinned (mapping the slab
        descriptors that came with it), and whether more frames follow. A page whose
        size is not its sink's is left out (it can never be the one asked for); a page
        named twice in one get is a protocol error (``seen``: the positions so far)."""
        plan, fds = await self._recv_frame(P.GetPlan)
        self._slabs.map(plan.mapped, fds)
        present = plan.present.astype(np.int64)
        arrays = (plan.sizes, plan.checksums, plan.regions, plan.offsets)
        if any(len(a) != len(present) for a in arrays) or (
            len(present)
            and (
                int(present.max()) >= len(hashes)
                # in request order: a part's rows are then a range but where pages lack
                or (np.diff(present) <= 0).any()
                # no slab is this large: the arithmetic on them stays in int64
                or int(plan.offsets.max()) >= MAX_SLAB_BYTES
                or int(plan.sizes.max()) >= MAX_SLAB_BYTES
            )
        ):
            raise ProtocolError(f"node {self.node.node_id} sent an inconsistent get plan")
        before = int(np.count_nonzero(seen))
        seen[present] = True
        if int(np.count_nonzero(seen)) != before + len(present):  # named twice, or again
            raise ProtocolError(f"node {self.node.node_id} planned a page twice")
        part = PlanPart(present, *arrays)
        if len(present):
            sizes = (
                sinks.nbytes
                if isinstance(sinks, DeviceRows)
                else [sinks[i].nbytes for i in present.tolist()]
            )
            part = part.kept(self._maps, sizes)
        return part, bool(plan.more)

    async def _get(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: list[Span],
        expected: Expected,
        probe: bool,
    ) -> GetOutcome:
        await self._ask_get(namespace, hashes, sinks, probe)
        seen = np.zeros(len(hashes), dtype=bool)
        parts, more = [], True
        while more:  # frames before the last carry descriptors only: one plan
            part, more = await self._plan_part(hashes, sinks, seen)
            parts.append(part)
        part = PlanPart.joined(parts)
        copies = [
            (sinks[i].bytes(), self._maps[r][off : off + size]) for i, r, off, size in part.rows()
        ]
        digests = copy_checksummed(copies)  # the one copy; hashes of the bytes that landed
        await self._channel().send_frame(P.GetDone())  # the node unpins
        return part.outcome(digests, expected)

    async def _get_device(
        self,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: DeviceRows,
        expected: Expected,
        slots: np.ndarray | None = None,
    ) -> GetOutcome:
        """A get into device memory straight from the node's slots: each page is copied
        by DMA from the slab's mapping (registered with the device once) into its sink
        and checked on the device against the index's checksum (client.memory.device_pages).
        When every page's index slot lies in a slab an earlier device get registered,
        they are read at once, with no plan (``client.nodes.slot_reads``), and those whose
        check failed (moved since) through a plan; otherwise every page through a plan
        (``_planned``), which maps and registers their slabs for the next get. Only a
        slab read through a plan is read from its slots: the node had just lent its
        current generation, and registering a stale mapping (its memfd emptied when the
        slab went to another tenant) would fault the emptied memory back in. A get
        landing layer by layer always goes through a plan: it could not ask a failed page
        again (the forward may have read its layers), and a page that came back from the
        node's disk, whose index slot is stale, would then be recomputed on every load."""
        device = self._device_copier()
        direct = None
        if slots is not None and sinks.feed is None:
            direct = slot_part(
                self.node, slots, expected, self._slabs.registered_views(), sinks.nbytes
            )
        if direct is None or len(direct.present) < len(hashes):
            return await self._planned(device, namespace, hashes, sinks, expected)
        good = await self._read_slots(device, namespace, hashes, sinks, direct)
        device.stats.slot_reads += len(direct.present)
        rest = np.flatnonzero(~good)
        device.stats.slot_read_misses += len(rest)
        if not len(rest):
            return GetOutcome(np.flatnonzero(good).tolist(), 0)
        more = await self._planned(
            device,
            namespace,
            [hashes[i] for i in rest.tolist()],
            sinks.take(rest),
            np.asarray(expected, dtype=np.uint64)[rest],
        )
        good[rest[np.asarray(more.ok, dtype=np.int64)]] = True
        return GetOutcome(np.flatnonzero(good).tolist(), more.corrupt)

    async def _read_slots(
        self,
        device: DeviceCopier,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: DeviceRows,
        part: PlanPart,
    ) -> np.ndarray:
        """Land ``part`` (pages at their index slots, ``slot_part``) and tell the node
        (``SlotReads``) while the copies run; per request position, whether its page
        landed and its bytes hash to the index's checksum (``part.checksums``)."""
        landing = device.landing(sinks)
        self._landing.append(landing)
        done = False
        try:
            landing.add(part.present, self._copies(device, part, sinks))
            await self._ask(slot_reads(namespace, self.token, [hashes[i] for i in part.present]))
            digests = await landing.digests()
            done = True
        finally:
            if not done:
                landing.settle()
            self._landing.clear()
        good = np.zeros(len(hashes), dtype=bool)
        good[part.present[digests[part.present] == part.checksums]] = True
        return good

    async def _planned(
        self,
        device: DeviceCopier,
        namespace: NamespaceKey,
        hashes: list[bytes],
        sinks: DeviceRows,
        expected: Expected,
    ) -> GetOutcome:
        """A device get through the node's plan, which pins the pages until every copy
        and check has finished (GET_DONE). The plan comes in parts of about
        ``PART_BYTES`` (a get landing layer by layer: in one), each part's copies queued
        as it arrives, while the node plans the next."""
        part_pages = 0
        if sinks.feed is None:
            part_pages = min(len(hashes), max(1, PART_BYTES // sinks.nbytes))
        await self._ask_get(namespace, hashes, sinks, False, part_pages)
        seen = np.zeros(len(hashes), dtype=bool)
        landing = device.landing(sinks)
        self._landing.append(landing)
        parts: list[PlanPart] = []
        more, done = True, False
        try:
            while more:
                part, more = await self._plan_part(hashes, sinks, seen)
                if len(part.present):
                    landing.add(part.present, self._copies(device, part, sinks))
                    parts.append(part)
            digests = await landing.digests()
            done = True
        finally:
            if not done:  # a part failed or the get was cancelled: nothing lands later
                landing.settle()
            self._landing.clear()
        # the pins hold until here; every copy is over (and was checked)
        await self._channel().send_frame(P.GetDone())
        if not parts:
            return GetOutcome([], 0)
        landed = PlanPart.joined(parts)
        return landed.outcome(digests[landed.present], expected)

    def _copies(self, device: DeviceCopier, part: PlanPart, sinks: DeviceRows) -> PageCopies:
        """A plan part's copies from the slabs' mappings, each registered with the
        device once (by the first get that reads from it)."""
        assert part.slabs is not None and part.slab_index is not None  # ``kept`` set them
        sources = []
        for region in part.slabs.tolist():
            view = self._slabs.for_device(region, device)
            # a slab none of the part's pages lies in (``kept``) stays unmapped
            sources.append(_NOTHING if view is None else view)
        return PageCopies(
            sinks.base,
            sinks.offsets[part.present],
            sources,
            part.slab_index,
            part.offsets.astype(np.int64),
            sinks.nbytes,
            sinks.feed,
        )

    async def close(self) -> None:
        self.broken = True
        ch, self._ch = self._ch, None
        if ch is not None:
            ch.close()
        self._slabs.release()
