"""Child process of tests/sglang/test_sglang_hicache.py: ``client.sglang.KVStoreHiCache``
built as SGLang's factory builds it, ``(storage_config, host pool)``, plus the store
seam (``stores``: tests/support/memory_store.py's ``MemoryStore``, real page bytes
under the real client's keyed hashes), over SGLang's own host pool and page keys. No
storage node and no index: the extra config names an index nobody listens on, so a real
client would miss everything. Prints one JSON line per check, in the order asked; the
tests assert on them.

    python tests/support/sglang_memory_checks.py memory config"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.support.sglang_site import define_torchvision_ops, make_host_pool, make_mamba_pool

define_torchvision_ops()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from client.sglang.backend import KVStoreHiCache  # noqa: E402
from tests.support.memory_store import MemoryStore  # noqa: E402
from tests.support.sglang_pools import (  # noqa: E402
    PAGE,
    config,
    fill,
    page_bytes,
    page_keys,
    refused,
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


def config_checks() -> None:
    """What SGLang's attach meets for a configuration the backend does not serve: one
    line naming what is wrong (each raised where SGLang's factory builds the backend, as
    ``backend`` builds it here, or registers a pool)."""
    memory = MemoryStore()
    pool = make_host_pool("page_first")

    def backend(extra: dict[str, Any], host_pool: Any = pool) -> KVStoreHiCache:
        return KVStoreHiCache(config(NOBODY, **extra), host_pool, stores=memory.client)

    out = {
        "typo": refused(lambda: backend({"tennant": "a"})),
        "bad_tenant": refused(lambda: backend({"tenant": "a b"})),
        "bad_option": refused(lambda: backend({"timeout": -1})),
        "context_parallel": refused(lambda: backend({"attn_cp_size": 2})),
        "no_model": refused(lambda: backend({"model_name": None})),
        "unified": refused(lambda: backend({}, make_host_pool("page_unified"))),
    }
    store = backend({})
    side = make_mamba_pool(side_state=True)  # slot side states: SGLang's zero-copy refuses
    out["hybrid"] = refused(lambda: store.register_mem_host_pool_v2(side, PoolName.MAMBA))
    window = make_host_pool("page_first")
    out["compressed"] = refused(
        lambda: store.register_mem_host_pool_v2(window, PoolName.DEEPSEEK_V4_C4)
    )
    fp8 = make_host_pool("page_first", dtype=torch.uint8)  # how SGLang holds fp8 KV
    out["fp8"] = refused(lambda: backend({}, fp8))
    fp8_stores = [
        backend({"kv_cache_dtype": kind}, fp8) for kind in ("float8_e4m3fn", "float8_e5m2")
    ]
    out["fp8_dtypes"] = [s.pages.namespace.dtype for s in fp8_stores]
    fp8_window = make_host_pool("page_first", dtype=torch.uint8)
    for fp8_store in fp8_stores:
        fp8_store.register_mem_host_pool_v2(fp8_window, PoolName.SWA)
    out["fp8_side_namespaces"] = len({s._pools["swa"].pages.namespace.digest for s in fp8_stores})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for what in sys.argv[1:]:  # several in one process: SGLang's import is most of the time
        {"memory": memory, "config": config_checks}[what]()
