"""A registered host pool (``Pool``: its pages, its namespace's store, whether this
rank writes them) and the index and node calls the HiCache backend makes of it
(``PoolCalls``), each turning a fault into a miss.

Called by ``client.sglang.backend.KVStoreHiCache`` from SGLang's prefetch and backup
threads. Guarantees: no call raises (an index or node that cannot be reached, a
timeout, a refused credential is None, 0 or all False), and each fault is counted in
``failures`` by kind ("lookup", "get", "set") and logged at most once a minute per
kind. Imports nothing of SGLang."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from client.log_limit import LogLimit
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span
from client.sglang.pool_pages import PoolPages
from client.sglang.store import KeyedStore

NOT_REGISTERED = "SGLang has not registered its host pool with the backend"


@dataclass
class Pool:
    """One registered host pool: its pages, the store of their namespace
    (``client.sglang.store.KeyedStore``: a ``KVCacheClient`` unless the backend was
    handed an opener), and whether this rank writes them (MLA's latent KV: rank 0 only;
    a side pool: every rank)."""

    pages: PoolPages
    client: KeyedStore
    writes: bool


class PoolCalls:
    """The backend's fault counts (``failures``) and its calls that may meet a fault:
    ``find``, ``land`` and ``stored``; ``failed`` counts and logs any other."""

    def __init__(self, limit: LogLimit) -> None:
        self.failures: Counter[str] = Counter()
        self._limit = limit

    def find(
        self, pool: Pool | None, keys: list[str], *, lease: bool = True
    ) -> StoredPrefix | None:
        """The store's ``find_keys``, or None on any fault (counted, logged). Keys go
        without chain positions: SGLang 0.5.23's ``prefix_keys`` are not the keys
        before a prefetch's batch (its scheduler passes the ancestors of the node the
        host cache ended in, without that node's own keys), so positions read from them
        would place a prefetch's lookups where its backups never put the pages."""
        if not keys:
            return None
        if pool is None:
            self.failed("lookup", NOT_REGISTERED)
            return None
        try:
            found = pool.client.find_keys(keys, lease=lease)
        except Exception as exc:
            self.failed("lookup", exc)
            return None
        if found is None:
            self.failed("lookup", "the index did not answer")
        return found

    def land(self, pool: Pool, found: StoredPrefix, sinks: Callable[[], list[Span]]) -> int:
        """Pages of ``found`` landed in the spans ``sinks()`` makes, from the first on;
        one that was found but did not arrive (a node gone, a page evicted or failing
        its check) is counted and logged, as any fault on the way (0 then)."""
        try:
            got = pool.client.get_found_into(found, sinks()) // pool.pages.namespace.block_size
        except Exception as exc:  # a fault is a miss, never SGLang's exception
            self.failed("get", exc)
            return 0
        if got < found.blocks:
            self.failed("get", f"{found.blocks - got} of {found.blocks} pages found did not arrive")
        return got

    def stored(self, pool: Pool | None, name: str, keys: list[str]) -> list[bool]:
        """Which of ``keys``' pages the side pool ``pool`` (SGLang's ``name``) holds,
        each on its own; all False for a pool never registered or on a fault (counted,
        logged)."""
        if pool is None or not keys:
            if keys:
                self.failed("lookup", f"the {name} pool was never registered")
            return [False] * len(keys)
        try:
            present = pool.client.stored_keys(keys)
        except Exception as exc:
            self.failed("lookup", exc)
            return [False] * len(keys)
        if present is None:
            self.failed("lookup", "the index did not answer")
            return [False] * len(keys)
        return present

    def failed(self, kind: str, why: object) -> None:
        """A fault of ``kind``: counted, and logged at most once a minute."""
        self.failures[kind] += 1
        self._limit.warning(
            kind, "kvstore HiCache %s failed, counted as a miss or False: %s", kind, why
        )
