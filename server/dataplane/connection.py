"""A client connection of the data plane, whichever path it came by.

Two paths share one request logic: UCX endpoints (any host; payloads are received
straight into pool slots and sent straight from them: server/dataplane/ucx.py) and
Unix sockets for clients on the node's host (pages move through shared memory with
one copy: server/dataplane/same_host.py). The path is chosen once, when the
connection is accepted (``DataPlane.serve``, ``DataPlane.serve_unix``); the PUT and
GET handlers take the steps below and never ask which path they have."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import ClassVar, TypeVar

import numpy as np
from pydantic import BaseModel

from kvstore.errors import ProtocolError
from kvstore.wire import protocol as P
from kvstore.wire import shm
from kvstore.wire.transport import with_timeout
from server.dataplane.batch import PutBatch
from server.dataplane.errors import Broken
from server.page import StoredPage

F = TypeVar("F", bound=BaseModel)


class Connection(ABC):
    """One client connection: its control frames, each sent or expected within the
    transfer timeout, and the steps by which a request's pages move over its path."""

    path: ClassVar[str]  # "ucx" or "shm": the label of its metrics
    # whether a get's plan may go in parts (``GetRequest.part_pages``; same host only)
    plans_in_parts: ClassVar[bool] = False

    def __init__(self, frame_seconds: float, timeout: float) -> None:
        self.frame_seconds = frame_seconds  # how long a frame may take once it started
        self.timeout = timeout  # how long one step of a request may take

    # ---- the transport --------------------------------------------------------------

    @abstractmethod
    async def recv(self, first_timeout: float | None = None) -> tuple[bytes, list[int]]:
        """The next control frame's bytes and the descriptors sent with it;
        ``TimeoutError`` when none starts within ``first_timeout`` (None: no limit)."""

    @abstractmethod
    async def linger(self) -> None:
        """Before closing after an error reply: let the reply reach the peer."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; afterwards nothing lands in a slot it was given."""

    @abstractmethod
    async def _send_frame(self, frame: BaseModel, fds: list[int]) -> None:
        """Send one control frame (with descriptors, where the path carries them)."""

    # ---- control frames ---------------------------------------------------------------

    async def send(self, frame: BaseModel, fds: list[int] | None = None) -> None:
        """Send a reply within the timeout; ``Broken`` when it cannot be sent."""
        try:
            await with_timeout(self._send_frame(frame, fds or []), self.timeout, "control reply")
        except Exception as exc:
            raise Broken(f"cannot reply: {exc}") from exc

    async def expect(self, kind: type[F], what: str) -> tuple[F, list[int]]:
        """The next frame, which must be ``kind``: anything else (or nothing within the
        timeout) leaves the connection out of step."""
        try:
            raw, fds = await with_timeout(self.recv(), self.timeout, what)
        except Exception as exc:
            raise Broken(f"no {what}: {exc}") from exc
        try:
            frame = P.decode(raw)
        except ProtocolError as exc:
            shm.close_fds(fds)
            raise Broken(f"bad {what}: {exc}") from exc
        if not isinstance(frame, kind):
            shm.close_fds(fds)
            raise Broken(f"expected {kind.__name__}, got {type(frame).__name__}")
        return frame, fds

    async def reply_error(self, code: P.RefusalCode, message: str) -> None:
        """Answer with an ERROR frame, if the connection still takes one."""
        try:
            await self.send(P.ErrorFrame(code=code, message=message))
        except Broken:
            pass

    # ---- a request's pages, as its path moves them ----------------------------------------

    @abstractmethod
    async def send_put_plan(self, batch: PutBatch) -> None:
        """Tell the client where the put's wanted pages go (``PutPlan``), and get ready to
        receive them (the slots are assigned)."""

    @abstractmethod
    async def plan_delivered(self, batch: PutBatch) -> None:
        """The plan's sends have finished; ``Broken`` when they failed."""

    @abstractmethod
    def arrived(self, batch: PutBatch) -> AsyncIterator[tuple[int, int]]:
        """Ranges ``[start, end)`` of the put's wanted pages whose bytes are in their slots,
        as they arrive (called once the checksums are in)."""

    @abstractmethod
    async def send_pages(
        self,
        req: P.GetRequest,
        present: list[int],
        pages: list[StoredPage],
        sizes: list[int],
        checksums: np.ndarray,
        more: bool = False,
    ) -> int:
        """Answer a get with its plan and the pinned pages, in memory; returns the payload
        messages sent. ``more``: one part of a plan in parts, more to follow (only
        where ``plans_in_parts``)."""
