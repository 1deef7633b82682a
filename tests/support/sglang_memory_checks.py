"""Child process of tests/sglang/test_sglang_hicache.py: ``client.sglang.KVStoreHiCache``
built as SGLang's factory builds it, ``(storage_config, host pool)``, plus the store
seam (``stores``: tests/support/memory_store.py's ``MemoryStore``, real page bytes
under the real client's keyed hashes), over SGLang's own host pool and page keys. No
storage node and no index: the extra config names an index nobody listens on, so a real
client would miss everything. Prints one JSON line; the test asserts on it.

    python tests/support/sglang_memory_checks.py memory"""

from __future__ import annotations

import json
import sys

from tests.support.sglang_site import define_torchvision_ops, make_host_pool

define_torchvision_ops()

from client.sglang.backend import KVStoreHiCache  # noqa: E402
from tests.support.memory_store import MemoryStore  # noqa: E402
from tests.support.sglang_pools import (  # noqa: E402
    PAGE,
    config,
    fill,
    page_bytes,
    page_keys,
    same_pages,
)

NOBODY = "redis://127.0.0.1:1"  # no index: only the memory store can answer


def memory() -> None:
    """A backup of 6 of a prompt's 8 pages (``batch_set_v1``), then what SGLang's
    prefetch asks of it: ``batch_exists`` and ``batch_get_v1`` of the 8, of the 2 never
    stored and of another prompt; a get whose 4th page is evicted between the lookup and
    the fetch; an index that cannot answer; the backend closed."""
    memory = MemoryStore()
    pool = make_host_pool("page_first")
    hicache = KVStoreHiCache(config(NOBODY), pool, stores=memory.client)
    (client,) = memory.opened
    keys = page_keys(600, 8)
    src = fill(pool, 8, 600)
    out: dict = {
        "seam": hicache.client is client and client.namespace == hicache.pages.namespace,
        "stored": hicache.batch_set_v1(keys[:6], src[: 6 * PAGE]),
        "held": client.stored_keys(keys),
        "pages": len(memory),
    }
    out["exists"] = hicache.batch_exists(keys)
    out["exists_unstored"] = hicache.batch_exists(keys[6:])
    out["exists_other"] = hicache.batch_exists(page_keys(601, 4))
    dst = pool.alloc(8 * PAGE)
    out["got"] = hicache.batch_get_v1(keys, dst)
    out["same"] = same_pages(pool, src, dst, 6)
    out["got_other"] = hicache.batch_get_v1(page_keys(601, 2), pool.alloc(2 * PAGE))
    out["misses_failed"] = dict(hicache.failures)  # a miss is no fault
    out["leases"] = list(client.keyed_finds)  # each lookup's keys, and whether leased
    found = client.find_keys(keys)  # what the store holds: the pool's page bytes
    out["held_bytes"] = [
        page == page_bytes(pool, src, i) for i, page in enumerate(client.pages(found))
    ]

    # the 4th page evicted after the lookup found it, before its fetch: a shorter hit
    memory.evict_on_read(client.keyed_chain([keys[3]]))
    evicted = pool.alloc(6 * PAGE)
    out["got_evicted"] = hicache.batch_get_v1(keys[:6], evicted)
    out["same_evicted"] = same_pages(pool, src, evicted, 3)
    out["evicted_failed"] = dict(hicache.failures)
    out["exists_evicted"] = hicache.batch_exists(keys)

    client.down = True  # the index cannot answer: misses, each counted
    out["down_exists"] = hicache.batch_exists(keys)
    out["down_got"] = hicache.batch_get_v1(keys[:2], pool.alloc(2 * PAGE))
    out["down_failed"] = dict(hicache.failures)
    hicache.close()
    out["closed"] = client.closed
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        memory()
