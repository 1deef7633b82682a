"""``LayerFeed``: a get into device rows that lands one layer at a time, and tells the
engine's forward pass, layer by layer, when that layer of every page is in place.

A page holds one block of every layer, layer after layer (``[layers, heads, block, ...]``),
so layer ``l`` of each page is one contiguous slice of it. A copier that lands a get with
a feed (``client.memory.device_pages``) copies slice 0 of every page, then slice 1, and
so on, and after each layer's copies records an event it hands to ``queued``. The
forward pass asks ``take(l)`` before its layer ``l`` reads the cache: it waits until that
layer of every page was queued (or the get ended), and gets the events its stream must
wait on. So the load of layer ``l + 1`` crosses the bus while layer ``l`` computes.

"Never wrong KV" holds without the pages' checks in front of the forward: a page whose
layer was not queued when the forward took that layer (it came later, or never) is
``late``, and the caller reports it failed with any page its checks reject, so the engine
recomputes it and drops what this step sampled from it (vLLM does so for sync loads).

Thread use: ``queued`` on the client's event loop, ``take`` on the engine thread,
``close`` on the thread that ran the get."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class LayerFeed:
    """The per-layer state of one get of ``pages`` pages of ``layers`` layers each into
    one tensor of device rows (row ``i``: the ``i``-th page asked for)."""

    def __init__(self, layers: int, pages: int) -> None:
        if layers < 1 or pages < 0:
            raise ValueError(
                f"a feed needs at least one layer and no negative pages ({layers}, {pages})"
            )
        self.layers = layers
        self.pages = pages
        self._cond = threading.Condition()
        self._queued: list[set[int]] = [set() for _ in range(layers)]
        self._events: list[list[Any]] = [[] for _ in range(layers)]
        self._taken = [False] * layers
        self._closed = False
        self._late: set[int] = set()

    def queued(self, layer: int, rows: Iterable[int], event: Any) -> None:
        """Copier: layer ``layer`` of ``rows`` is queued, done once ``event`` (a CUDA
        event; None where the copy already happened) has passed. Rows of a layer the
        forward already took are late."""
        with self._cond:
            if self._taken[layer]:
                self._late.update(rows)
                return
            self._queued[layer].update(rows)
            if event is not None:
                self._events[layer].append(event)
            self._cond.notify_all()

    def take(self, layer: int, timeout: float) -> list[Any]:
        """Engine thread, before layer ``layer`` reads the cache: wait (at most
        ``timeout`` seconds) until that layer of every page is queued or the get ended;
        the events to wait on. Rows not queued by then are late from now on."""
        with self._cond:
            if not self._taken[layer]:
                self._cond.wait_for(
                    lambda: self._closed or len(self._queued[layer]) >= self.pages, timeout
                )
                self._taken[layer] = True
                self._late.update(set(range(self.pages)) - self._queued[layer])
            return list(self._events[layer])

    def close(self) -> None:
        """The get ended (whatever its outcome): nothing more will be queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def untaken(self) -> list[int]:
        """Layers the forward never took (their rows never reached the cache)."""
        with self._cond:
            return [layer for layer, taken in enumerate(self._taken) if not taken]

    def first_late(self) -> int:
        """The first row that was late for some layer (``pages`` when none was)."""
        with self._cond:
            return min(self._late, default=self.pages)
