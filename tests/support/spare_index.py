"""Embedded 3-shard Valkey clusters started one test ahead (``SpareIndexes``), for the
``clusters`` fixture of tests/conftest.py.

A Valkey cluster serves its slots no sooner than 2 s after its servers started (Valkey
keeps a restarted primary out of service that long, ``CLUSTER_WRITABLE_DELAY``;
measured here: 2.0 s from the last MEET to ``cluster_state:ok``, 2.2 s a start), and
about 45 tests run on one (``ON_BOTH_INDEXES``): started while the test before runs,
that wait is off the suite's time. Each test still gets a fresh cluster of its own;
only its start moved."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from kvstore.tools.valkey import EmbeddedValkeyCluster


class SpareIndexes:
    """Hands out started ``EmbeddedValkeyCluster``s of ``shards`` primaries (``take``),
    starting the next in a background thread once one is taken. A start that failed
    raises from ``take``, as starting it there would have. ``close`` stops the spare."""

    def __init__(self, shards: int) -> None:
        self._shards = shards
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="spare-index")
        self._next: Future[EmbeddedValkeyCluster] | None = None

    def _start(self) -> EmbeddedValkeyCluster:
        return EmbeddedValkeyCluster(self._shards).start()

    def take(self) -> EmbeddedValkeyCluster:
        """A started cluster, the caller's to stop."""
        ready = self._next or self._starter.submit(self._start)
        self._next = self._starter.submit(self._start)
        return ready.result()

    def close(self) -> None:
        spare, self._next = self._next, None
        if spare is not None:
            try:
                spare.result().stop()
            except Exception:  # a spare that never started has nothing to stop
                pass
        self._starter.shutdown()
