"""The same-host listener: a Unix socket that accepts clients on the node's host.

UCX clients arrive through ucxx's own listener (kvstore.wire.transport.listen), which
calls ``DataPlane.serve`` for each endpoint; clients on the node's host connect to
this socket instead (kvstore.wire.shm), and each accepted one goes to
``DataPlane.serve_unix``."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket

from server.dataplane import DataPlane
from server.limits import RateLimitedLog
from server.metrics import NodeMetrics

log = logging.getLogger(__name__)
# An accept that fails (EMFILE, ENFILE, ENOBUFS) is retried after this long, doubling
# up to ACCEPT_BACKOFF_MAX: the listener outlives any burst of failures.
ACCEPT_BACKOFF = 0.05
ACCEPT_BACKOFF_MAX = 1.0


class SameHostListener:
    """Accepts same-host clients on a Unix socket in ``directory`` and hands each to the
    data plane, until closed."""

    def __init__(
        self, directory: str, node_id: str, plane: DataPlane, metrics: NodeMetrics
    ) -> None:
        self.directory = directory
        self.plane = plane
        self.metrics = metrics
        self._stem = f"kvstore-{re.sub(r'[^A-Za-z0-9_.-]', '_', node_id)}"
        # The pid keeps two stores on one host apart (tests, a second registry).
        self.path = os.path.join(directory, f"{self._stem}-{os.getpid()}.sock")
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()  # connections being served

    def start(self) -> bool:
        """Listen (owner and group may connect: share the group with engine pods) and
        accept on the running loop; False, and a warning, when the socket cannot be made."""
        _remove_stale_sockets(self.directory, self._stem)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o660)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            log.warning("same-host path off: cannot listen on %s: %s", self.path, exc)
            return False
        sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._accept(sock))
        return True

    def close(self) -> None:
        """Stop accepting; the socket file goes."""
        if self._task is not None:
            self._task.cancel()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        failures = RateLimitedLog(log)
        backoff = ACCEPT_BACKOFF
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(sock)
                except (
                    OSError
                ) as exc:  # out of descriptors or buffers: wait, never give up the socket
                    self.metrics.accept_errors.inc()
                    failures("same-host accept failed, retrying in %.2f s: %s", backoff, exc)
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX)
                    continue
                backoff = ACCEPT_BACKOFF
                # held until it ends: the loop keeps only a weak reference to a task
                task = loop.create_task(self.plane.serve_unix(conn))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)
        finally:
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _remove_stale_sockets(directory: str, stem: str) -> None:
    """Unlink Unix sockets that killed nodes of this node id left behind."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid = name[len(stem) + 1 : -len(".sock")]
        if (
            name.startswith(stem + "-")
            and name.endswith(".sock")
            and pid.isdigit()
            and not os.path.exists(f"/proc/{pid}")
        ):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
