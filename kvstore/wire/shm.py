"""The same-host data path: control frames over a Unix socket, pages through shared memory.

When a client runs on the node's host (the DaemonSet deployment), UCX's loopback
TCP would copy every byte through the kernel twice and cap transfers near a
quarter of memcpy. Instead:

- **GET**: the node's pool slabs are memfds (server/pool.py). The node answers a
  GET with where each page lies and passes the client a *read-only* descriptor of
  each slab it has not sent yet (SCM_RIGHTS); the client maps it, copies each page
  straight into the caller's memory (the one copy, hashed as it lands), says GET_DONE
  so the node unpins, and verifies the checksums. A slab only ever holds one tenant's pages and gets a
  fresh memfd when it changes tenant, so a client never maps another tenant's bytes.
- **PUT**: the node answers with the slots it assigned to the wanted pages and a
  *writable* descriptor of each of those slabs the client lacks (slabs of the
  client's tenant only); the client copies each page into its slot (the one copy,
  hashing its own bytes as it goes), and the node verifies every page before commit. The memfds are sealed
  against shrinking and growing, so a client cannot make the node fault (SIGBUS).
  A writer could scribble on its own tenant's pages later, but a writer can already
  publish wrong bytes under any hash of its tenant; readers verify the index's
  checksum either way, so a scribbled page is a miss, never wrong KV.

Why not UCX's own shared-memory or CMA transports: listener endpoints use error
handling, which keeps UCX on TCP; and CMA would let the reader ``process_vm_readv``
the node, that is, every tenant's pages. Why not have the node write into the
client (process_vm_writev): a node stalled past the client's timeout could write
into memory the caller already reused; here the node never writes into a client.

A client whose copy runs past its timeout closes the socket; a page the node
evicted meanwhile reads as zeros or other bytes and fails its checksum: a miss.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from kvstore.errors import ProtocolError, TransportError
from kvstore.wire import protocol as P

MAX_FDS_PER_FRAME = 253  # SCM_MAX_FD


@lru_cache(maxsize=1)
def host_id() -> str:
    """Identity of the running kernel: processes with the same value can share memfds."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class DescriptorsRefusedError(ProtocolError):
    """A peer sent file descriptors to a channel that takes none (a node's)."""


class PeerClosedError(TransportError):
    """The other end had closed the socket before a frame went out: none of the frame
    reached it (a node that restarted since the connection was made)."""


class UnixChannel:
    """A connected, non-blocking Unix stream socket carrying control frames, each with
    optional file descriptors. One request at a time per channel (callers serialise).

    A node's channels take no descriptors (``accept_fds=False``): clients never send
    any, so a frame that carries some is refused, and the kernel drops them before
    they reach the node's descriptor table (it installs none when the receive has no
    room for ancillary data; measured: 200 sent, 0 installed, MSG_CTRUNC set). A
    client's channel takes at most ``MAX_FDS_PER_FRAME`` per message (SCM_RIGHTS'
    own limit) from the node it chose to reach."""

    def __init__(self, sock: socket.socket, accept_fds: bool = True) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._fds: list[int] = []  # received, not yet claimed by a frame
        self._ancillary = (
            socket.CMSG_SPACE(MAX_FDS_PER_FRAME * array.array("i").itemsize) if accept_fds else 0
        )

    async def _wait(self, writable: bool) -> None:
        fut = self._loop.create_future()
        fd = self.sock.fileno()
        add, remove = (
            (self._loop.add_writer, self._loop.remove_writer)
            if writable
            else (self._loop.add_reader, self._loop.remove_reader)
        )

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(fd, ready)
        try:
            await fut
        finally:
            remove(fd)

    async def send_frame(self, frame: Any, fds: Sequence[int] = ()) -> None:
        """Send one frame (with ``fds``); ``PeerClosedError`` when the other end had
        closed the socket before any of it went out."""
        data = memoryview(P.encode(frame))
        whole = len(data)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while data:
            try:
                sent = self.sock.sendmsg([data], ancillary)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                if len(data) == whole:
                    raise PeerClosedError(f"unix socket send failed: {exc}") from None
                raise TransportError(f"unix socket send failed: {exc}") from None
            except OSError as exc:
                raise TransportError(f"unix socket send failed: {exc}") from None
            data, ancillary = data[sent:], []

    async def _recv_exact(self, n: int, at_least: int | None = None) -> bytes:
        """``n`` bytes; with ``at_least``, whatever has arrived once that many have (at
        most ``n``)."""
        out = bytearray()
        while len(out) < (n if at_least is None else at_least):
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(
                    n - len(out), self._ancillary, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=False)
                continue
            except OSError as exc:
                raise TransportError(f"unix socket receive failed: {exc}") from None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self._fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                if not self._ancillary:
                    raise DescriptorsRefusedError(
                        "this node takes no file descriptors from clients"
                    )
                raise ProtocolError("descriptors were truncated")
            if not data:
                raise TransportError("peer closed the unix socket")
            out += data
        return bytes(out)

    async def recv_frame(
        self,
        max_body: int = P.MAX_BODY_BYTES,
        rest_timeout: float = P.FRAME_REST_TIMEOUT,
        first_timeout: float | None = None,
    ) -> tuple[bytes, list[int]]:
        """One frame's bytes (for ``P.decode``) and the descriptors that came with it;
        the caller owns (and must close) the descriptors. Waits for a frame's first byte
        up to ``first_timeout`` (None: as long as it takes; ``TimeoutError`` after it);
        the rest must follow within ``rest_timeout`` seconds or ``ProtocolError`` is
        raised (the stream is then out of step: close the channel)."""
        # one receive of up to the whole preamble, usually all of it, waits for the start
        head = await asyncio.wait_for(self._recv_exact(P.PREAMBLE.size, at_least=1), first_timeout)
        try:
            async with asyncio.timeout(rest_timeout):
                if len(head) < P.PREAMBLE.size:
                    head += await self._recv_exact(P.PREAMBLE.size - len(head))
                body = await self._recv_exact(P.announced_length(head, max_body))
        except TimeoutError:
            raise ProtocolError(
                f"a control frame did not arrive whole within {rest_timeout:.1f} s of its first byte"
            ) from None
        fds, self._fds = self._fds, []
        return head + body, fds

    def close(self) -> None:
        close_fds(self._fds)
        self._fds = []
        try:
            self.sock.close()
        except OSError:
            pass


def close_fds(fds: list[int]) -> None:
    """Close received or created descriptors, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def reopen(fd: int, writable: bool) -> int:
    """A new descriptor of the same memfd, writable or read-only: whoever receives a
    read-only one can map the memory for reading only."""
    return os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
