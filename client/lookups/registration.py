"""The client's namespace in the index: registered at start, and again by any call
that finds it missing (an index that was unreachable at start, or lost its keys)."""

from __future__ import annotations

import asyncio
import logging

from kvstore.errors import Fault
from kvstore.index import AsyncPageIndex
from kvstore.pages.namespace import Namespace

log = logging.getLogger(__name__)


class NamespaceRegistration:
    """One job: keep the client's storage namespace registered in the index. Called on
    the client's event loop (start, lookups and puts before it succeeded, a put that a
    node refused for an unknown namespace); ``registered`` and ``error`` may be read
    from any thread. A failure is logged and retried on the next call, never raised: an
    engine must not fail because its cache is down."""

    def __init__(self, index: AsyncPageIndex, storage: Namespace) -> None:
        self._index = index
        self._storage = storage
        self.registered = False
        self.error: str | None = None  # why the last registration failed
        # the registration in flight: callers at once (a put refused by every node
        # after the index lost the namespace) share one index call
        self._pending: asyncio.Future[None] | None = None

    async def ensure(self) -> None:
        """Register the namespace unless a registration succeeded already."""
        if not self.registered:
            await self.again()

    async def again(self) -> None:
        """Register the namespace now (the index may have lost it); a call while one is
        in flight waits for that one."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._register())
        await asyncio.shield(self._pending)

    async def _register(self) -> None:
        try:
            await self._index.ensure_namespace(self._storage)
            self.registered = True
        except Fault as exc:
            self.registered = False
            self.error = str(exc)
            log.warning("cannot register the namespace (retried on the next call): %s", exc)
