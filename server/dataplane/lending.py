"""Lending a same-host client the pool's slabs: descriptors it maps, so pages move
through shared memory with one copy (kvstore.wire.shm)."""

from __future__ import annotations

from typing import Any

from kvstore.wire import protocol as P
from kvstore.wire import shm
from server.dataplane.connection import Connection
from server.dataplane.errors import Broken
from server.page import StoredPage
from server.store import PageStore


class SlabLender:
    """Tells one same-host client where each page's slot lies and lends it descriptors
    of the slabs it lacks; remembers which it was sent (generation, and whether
    writable), so each slab is lent once per generation."""

    def __init__(self, store: PageStore) -> None:
        self.store = store
        self.sent: dict[
            int, tuple[int, bool]
        ] = {}  # slab index -> (generation, writable) the client has

    async def lend(
        self,
        conn: Connection,
        kind: type[P.PutPlan] | type[P.GetPlan],
        fields: dict[str, Any],
        pages: list[StoredPage],
        writable: bool,
        also: list[int] | None = None,
        more: bool = False,
    ) -> None:
        """Same-host plan: where each page's slot lies (slab and offset), with descriptors
        of the slabs the client lacks at their current generation (and of the slabs
        ``also`` names): read-only for a GET, writable for a PUT (the client writes the
        wanted pages into their slots). More descriptors than one frame carries go in
        earlier frames marked ``more``; with ``more``, the last is marked too (a part of
        a plan sent in parts, more parts to follow)."""
        slab = self.store.allocator.slab_size
        offsets: list[int] = [p.offset for p in pages]  # type: ignore[misc]  # pinned: each holds its slot
        regions = [o // slab for o in offsets]
        pool = self.store.pool

        def lacks(r: int) -> bool:
            generation, has_write = self.sent.get(r, (-1, False))
            return generation != pool.regions[r].generation or (writable and not has_write)

        fresh = sorted({r for r in (*regions, *(also or ())) if lacks(r)})
        # One frame's descriptors are open at a time: a request holds at most
        # MAX_FDS_PER_FRAME of the node's descriptors, however many slabs it touches.
        for start in range(0, max(len(fresh), 1), shm.MAX_FDS_PER_FRAME):
            chunk = fresh[start : start + shm.MAX_FDS_PER_FRAME]
            last = start + shm.MAX_FDS_PER_FRAME >= len(fresh)
            mapped = [[r, pool.regions[r].generation] for r in chunk]
            body = (
                {
                    **fields,
                    "regions": regions,
                    "offsets": [o % slab for o in offsets],
                    "mapped": mapped,
                    "more": more,
                }
                if last
                else {"mapped": mapped, "more": True}
            )
            frame = kind.model_validate(body)
            fds: list[int] = []
            try:
                for r in chunk:
                    fds.append(shm.reopen(pool.regions[r].fd, writable))
                await conn.send(frame, fds)
            except OSError as exc:  # EMFILE: the client reads a miss, the node keeps serving
                raise Broken(f"cannot lend slab descriptors: {exc}") from exc
            finally:
                shm.close_fds(fds)
        for r in fresh:
            self.sent[r] = (pool.regions[r].generation, writable)
