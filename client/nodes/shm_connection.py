"""``ShmConnection``: one client's connection to a storage node on this host, over the
node's Unix socket, moving pages through shared memory (kvstore.wire.shm): one copy
between the node's slots and the caller's memory, hashed as it is copied."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from client.memory.buffers import Span
from client.memory.copy_plans import PageCopies
from client.memory.device_landing import Landing
from client.memory.device_pages import DeviceCopier, DeviceRows
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
)
from client.nodes.connection import Connection
from client.nodes.get_plan import PlanPart
from kvstore.errors import ProtocolError, TransportError
from kvstore.index import NodeInfo
from kvstore.pages.checksum import copy_checksummed
from kvstore.pages.keys import NamespaceKey
from kvstore.wire import protocol as P
from kvstore.wire import shm
from kvstore.wire.transport import with_timeout

# Mapping a slab the client has not seen costs page-table work before the first copy.
# Measured on a 64 MiB memfd slab (kernel 6.18, shmem without huge pages): MAP_POPULATE
# 5-6.6 ms; no populate and faults during the copy +2.8 ms (reads, which the kernel's
# fault-around maps 16 pages at a time) or +19 ms (writes, a fault per 4 KiB page);
# reading one byte per 64 KiB first 2.5-3 ms, after which reads and writes copy at full
# speed (shmem maps its pages writable on a read fault). In a put of 64 MiB into a fresh
# slab the mapping step fell from 5.6 to 2.5-2.8 ms (of about 25 ms); a steady client
# maps each slab of its tenant once and keeps it.
FAULT_AROUND = 64 << 10
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


class ShmConnection(Connection):
    """A node on this host, over its Unix socket and shared memory (kvstore.wire.shm)."""

    path = "shm"

    def __init__(self, node: NodeInfo, token: str, device: DeviceCopier | None = None) -> None:
        super().__init__(node, token, device)
        self._ch: shm.UnixChannel | None = None
        # slab -> its mapping (writable once a put lent it); the node tracks generations
        self._maps: dict[int, np.ndarray] = {}
        # slab -> the device copier's registration of its mapping (made by the first
        # device get that reads from it; undone before the mapping goes)
        self._registered: dict[int, Any] = {}
        # A connection dropped without close must not leave its mappings registered: once
        # unmapped, the range stays registered, and a later mapping at the same address
        # cannot be (seen on an H200 after a bench dropped a client unclosed:
        # cudaHostRegister refused a new slab mapping, error 712, already registered, and
        # that client's gets landed none of their pages). The finalizer runs before the
        # mappings are released.
        self._landing: list[Landing] = []  # the device get in flight's (one at a time)
        finalizer = weakref.finalize(self, _unregister_all, device, self._registered, self._landing)
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
            self._map(plan.mapped, fds)
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
        self._map(plan.mapped, fds)
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
    ) -> GetOutcome:
        """A get into device memory straight from the node's slots: each page is copied
        by DMA from the slab's mapping (registered with the device once) into its sink
        and checked on the device against the index's checksum (client.memory.device_pages);
        the node is told it may unpin once every copy and check has finished. The plan
        comes in parts of about ``PART_BYTES`` (a get landing layer by layer: in one),
        each part's copies queued as it arrives, while the node plans the next."""
        device = self._device_copier()
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
            mapped = self._maps.get(region)
            if mapped is None:  # none of the part's pages lies there (``kept``)
                sources.append(np.zeros(0, dtype=np.uint8))
                continue
            if region not in self._registered:
                self._registered[region] = device.register(mapped, mapped.flags.writeable)
            sources.append(mapped)
        return PageCopies(
            sinks.base,
            sinks.offsets[part.present],
            sources,
            part.slab_index,
            part.offsets.astype(np.int64),
            sinks.nbytes,
            sinks.feed,
        )

    def _unregister(self, region: int) -> None:
        token = self._registered.pop(region, None)
        if token is not None and self.device is not None:
            self.device.unregister(token)

    def _map(self, mapped: list[tuple[int, int]], fds: list[int]) -> None:
        """Map the slabs whose descriptors came with a plan (replacing stale generations
        and read-only mappings of slabs now lent for writing); the descriptors are
        closed, the mappings stay."""
        try:
            if len(mapped) != len(fds):
                raise ProtocolError(
                    f"node {self.node.node_id} sent {len(fds)} descriptors for {len(mapped)} slabs"
                )
            for (region, _generation), fd in zip(mapped, fds):
                size = os.fstat(fd).st_size
                writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                view = np.frombuffer(
                    mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot), dtype=np.uint8
                )
                int(
                    view[::FAULT_AROUND].sum()
                )  # one read per 64 KiB maps the slab (see FAULT_AROUND)
                self._unregister(region)  # the mapping it replaces goes now
                self._maps[region] = view
        finally:
            shm.close_fds(fds)

    async def close(self) -> None:
        self.broken = True
        ch, self._ch = self._ch, None
        if ch is not None:
            ch.close()
        for region in list(self._registered):
            self._unregister(region)
        self._maps.clear()


def _unregister_all(
    device: DeviceCopier | None, registered: dict[int, Any], landing: list[Landing]
) -> None:
    """Undo a connection's registrations (its finalizer: not ``close``d), once no copy
    of a get it had in flight (collected with it) can still read them."""
    for unfinished in landing:
        unfinished.settle()
    for token in registered.values():
        if token is not None and device is not None:
            device.unregister(token)
    registered.clear()
