"""Child process of tests/sglang/test_sglang_hicache.py: SGLang's own classes (its backend
factory, storage config, host pools, key hash and failure injector) driving
``client.sglang.KVStoreHiCache`` against real storage nodes. Prints one JSON line per
check; the test asserts on them.

    python tests/support/sglang_checks.py layouts REDIS_URL SAME_HOST
    python tests/support/sglang_checks.py ranks REDIS_URL
    python tests/support/sglang_checks.py prefix REDIS_URL
    python tests/support/sglang_checks.py readme REDIS_URL "README's SGLang arguments"
    python tests/support/sglang_checks.py faults REDIS_URL       (reads a line on stdin mid-way)
    python tests/support/sglang_checks.py hybrid REDIS_URL SAME_HOST
    python tests/support/sglang_checks.py hybrid_vs_file REDIS_URL

The configuration checks run against the memory store (sglang_memory_checks.py)."""

from __future__ import annotations

import json
import sys
import time

from tests.support.sglang_site import define_torchvision_ops, make_host_pool, make_mamba_pool

define_torchvision_ops()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tests.support.sglang_hybrid_checks import hybrid, hybrid_vs_file  # noqa: E402
from tests.support.sglang_pools import (  # noqa: E402
    PAGE,
    backend,
    config,
    fill,
    page_bytes,
    page_keys,
    same_pages,
    state_bytes,
)


def layouts(redis_url: str, same_host: bool) -> None:
    """Every host layout served, MHA and MLA: 6 of 8 pages stored through ``batch_set_v1``
    and found and read back bit for bit; then the copying path (no interface_v1)."""
    kinds = [
        (False, lay) for lay in ("page_first", "page_first_direct", "layer_first", "page_head")
    ]
    kinds += [(True, lay) for lay in ("page_first", "page_first_direct", "layer_first")]
    for n, (mla, layout) in enumerate(kinds):
        pool = make_host_pool(layout, mla=mla)
        store = backend(config(redis_url, mla=mla, same_host=same_host), pool)
        keys = page_keys(n, 8)
        src = fill(pool, 8, n)
        stored = store.batch_set_v1(keys[:6], src[: 6 * PAGE])
        again = store.batch_set_v1(keys[:6], src[: 6 * PAGE])  # held already: nothing sent
        dst = pool.alloc(8 * PAGE)
        got = store.batch_get_v1(keys, dst)
        # the copying path: flat pages as SGLang's generic get/set hands them
        flat_src = [pool.get_data_page(int(src[(6 + i) * PAGE])).clone() for i in range(2)]
        flat_set = store.batch_set(keys[6:], flat_src)
        flat_dst = [pool.get_dummy_flat_data_page() for _ in range(2)]
        flat_got = store.batch_get(keys[6:], flat_dst)
        flat_same = [
            got_page is not None and got_page.view(torch.uint8).equal(want.view(torch.uint8))
            for got_page, want in zip(flat_got, flat_src, strict=True)
        ]
        # pages stored through v1 read through the copying path, and the other way
        cross = store.batch_get(keys[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
        cross_same = [
            got_page is not None
            and got_page.view(torch.uint8).equal(
                pool.get_data_page(int(src[i * PAGE])).view(torch.uint8)
            )
            for i, got_page in enumerate(cross)
        ]
        back = pool.alloc(2 * PAGE)
        back_got = store.batch_get_v1(keys[6:], back)
        back_same = all(
            pool.get_data_page(int(back[i * PAGE]))
            .view(torch.uint8)
            .equal(flat_src[i].view(torch.uint8))
            for i in range(2)
        )
        out = {
            "layout": layout,
            "mla": mla,
            "page_layout": store.pages.namespace.layout,
            "stored": stored,
            "again": again,
            "exists": store.batch_exists(keys),
            "exists_from_2": store.batch_exists(keys[2:]),
            "exists_one": store.exists(keys[0]),
            "got": got,
            "same": same_pages(pool, src, dst, 6),
            "flat_set": flat_set,
            "flat_same": flat_same,
            "cross_same": cross_same,
            "back": back_got,
            "back_same": back_same,
            "failures": dict(store.failures),
        }
        print(json.dumps(out), flush=True)
        store.close()


def prefix_keys(redis_url: str) -> None:
    """SGLang with hicache_storage_pass_prefix_keys: calls carry prefix keys. A
    300-page prompt backed up in batches of 128 (as its backup thread does) is found
    and read from page 100 on (where a host-cache hit would end), batch by batch as its
    prefetch asks, and found from other keys asked without prefix keys."""
    pool = make_host_pool("page_first", pages=700)
    store = backend(config(redis_url), pool)
    keys = page_keys(700, 300)
    src = fill(pool, 300, 700)
    stored = []
    for at in range(0, 300, 128):
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:at])
        part = keys[at : at + 128]
        stored += store.batch_set_v1(part, src[at * PAGE : (at + len(part)) * PAGE], info)
    hits, got = [], []
    dst = pool.alloc(200 * PAGE)
    for at in range(100, 300, 128):
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:at])
        part = keys[at : at + 128]
        hits.append(store.batch_exists(part, info))
        slots = dst[(at - 100) * PAGE : (at - 100 + len(part)) * PAGE]
        got += store.batch_get_v1(part, slots, info)
    same = all(page_bytes(pool, src, 100 + i) == page_bytes(pool, dst, i) for i in range(200))
    print(
        json.dumps(
            {
                "stored": stored == [True] * 300,
                "hits": hits,
                "got": got == [True] * 200,
                "same": same,
                "unplaced_from_64": store.batch_exists(keys[64:70]),
                "unplaced_from_65": store.batch_exists(keys[65:70]),
                "failures": dict(store.failures),
            }
        ),
        flush=True,
    )


def readme(redis_url: str, args: str) -> None:
    """README's SGLang line as SGLang reads it: its own argument parser, then its own
    parsing of the extra config (which takes out the prefix-keys switch); the backend
    that config builds stores and reads a prompt the way the switch says."""
    import argparse
    import shlex

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(shlex.split(args))
    extra, *_, pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(
        parsed.hicache_storage_backend_extra_config
    )
    cfg = config(redis_url)
    cfg.extra_config = {**extra, "redis_url": redis_url}
    pool = make_host_pool(parsed.hicache_mem_layout, pages=300, page_size=PAGE)
    store = StorageBackendFactory.create_backend(parsed.hicache_storage_backend, cfg, pool)
    store.register_mem_pool_host(pool)
    keys = page_keys(900, 130)
    src = fill(pool, 130, 900)
    for at in range(0, 130, 128):
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:at] if pass_prefix_keys else None)
        store.batch_set_v1(keys[at : at + 128], src[at * PAGE : (at + 128) * PAGE], info)
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:70] if pass_prefix_keys else None)
    dst = pool.alloc(60 * PAGE)
    got = store.batch_get_v1(keys[70:], dst, info)
    print(
        json.dumps(
            {
                "backend": type(store).__name__,
                "interface_v1": cfg.extra_config.get("interface_v1"),
                "pass_prefix_keys": pass_prefix_keys,
                "enable_hierarchical_cache": parsed.enable_hierarchical_cache,
                "got": got == [True] * 60,
                "same": all(
                    page_bytes(pool, src, 70 + i) == page_bytes(pool, dst, i) for i in range(60)
                ),
                "failures": dict(store.failures),
            }
        ),
        flush=True,
    )


def ranks(redis_url: str) -> None:
    """TP ranks: each MHA rank reads its own heads' pages; an engine of another TP size,
    model or tenant misses; MLA's rank 1 writes nothing and reads rank 0's pages."""
    keys = page_keys(100, 4)
    pools = [make_host_pool("page_first") for _ in range(2)]
    stores = [backend(config(redis_url, rank=r, size=2), pools[r]) for r in range(2)]
    srcs = [fill(pools[r], 4, 200 + r) for r in range(2)]
    set_ok = [stores[r].batch_set_v1(keys, srcs[r]) for r in range(2)]
    dsts = [pools[r].alloc(4 * PAGE) for r in range(2)]
    got = [stores[r].batch_get_v1(keys, dsts[r]) for r in range(2)]
    own = [same_pages(pools[r], srcs[r], dsts[r], 4) for r in range(2)]
    crossed = same_pages(pools[0], srcs[0], dsts[1], 4, pools[1])
    tp1 = backend(config(redis_url), make_host_pool("page_first"))
    other_model = backend(config(redis_url, model_name="other/model"), make_host_pool("page_first"))
    other_tenant = backend(config(redis_url, tenant="someone-else"), make_host_pool("page_first"))
    wider = backend(config(redis_url), make_host_pool("page_first", head_dim=16))
    print(
        json.dumps(
            {
                "set": set_ok,
                "got": got,
                "own": own,
                "crossed": crossed,
                "tp1": tp1.batch_exists(keys),
                "other_model": other_model.batch_exists(keys),
                "other_tenant": other_tenant.batch_exists(keys),
                "other_geometry": wider.batch_exists(keys),
            }
        ),
        flush=True,
    )
    mla_keys = page_keys(300, 4)
    mla_pools = [make_host_pool("page_first", mla=True) for _ in range(2)]
    mla = [backend(config(redis_url, mla=True, rank=r, size=2), mla_pools[r]) for r in range(2)]
    mla_src = [fill(mla_pools[r], 4, 400 + r) for r in range(2)]
    reader_set = mla[1].batch_set_v1(mla_keys, mla_src[1])
    after_reader = mla[1].batch_exists(mla_keys)
    writer_set = mla[0].batch_set_v1(mla_keys, mla_src[0])
    mla_dst = mla_pools[1].alloc(4 * PAGE)
    mla_got = mla[1].batch_get_v1(mla_keys, mla_dst)
    # side pools beside MLA, as SGLang backs them up: a window pool written by rank 0
    # only (its storage writer) and read by both; Mamba states TP splits, every rank
    # writing and reading its own
    windows, states = [make_host_pool("page_first") for _ in range(2)], []
    for r in range(2):
        states.append(make_mamba_pool(slots=8))
        mla[r].register_mem_host_pool_v2(windows[r], PoolName.SWA)
        mla[r].register_mem_host_pool_v2(states[r], PoolName.MAMBA)
    window_src = [fill(windows[r], 1, 500 + r) for r in range(2)]
    state_slot = [states[r].alloc(1) for r in range(2)]
    for r in range(2):
        for buffer in (states[r].temporal_buffer, *states[r].conv_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(r)))

    def side_set(r: int) -> dict:
        return mla[r].batch_set_v2(
            [
                PoolTransfer(PoolName.SWA, host_indices=window_src[r], keys=mla_keys[3:]),
                PoolTransfer(PoolName.MAMBA, host_indices=state_slot[r], keys=mla_keys[3:]),
            ]
        )

    side_sets = [side_set(1), side_set(0)]  # the reader first: it writes no window page
    trailing = [
        PoolTransfer(name, keys=mla_keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        for name in (PoolName.SWA, PoolName.MAMBA)
    ]
    side_exists = [mla[r].batch_exists_v2(mla_keys, trailing).kv_hit_pages for r in range(2)]
    window_dst, state_dst = windows[1].alloc(PAGE), states[1].alloc(1)
    side_got = mla[1].batch_get_v2(
        [
            PoolTransfer(PoolName.SWA, host_indices=window_dst, keys=mla_keys[3:]),
            PoolTransfer(PoolName.MAMBA, host_indices=state_dst, keys=mla_keys[3:]),
        ]
    )
    print(
        json.dumps(
            {
                "reader_set": reader_set,
                "after_reader": after_reader,
                "writer_set": writer_set,
                "reader_got": mla_got,
                "reader_has_writers": same_pages(
                    mla_pools[0], mla_src[0], mla_dst, 4, mla_pools[1]
                ),
                "side_sets": side_sets,
                "side_exists": side_exists,
                "side_got": side_got,
                "window_is_writers": same_pages(
                    windows[0], window_src[0], window_dst, 1, windows[1]
                ),
                "state_is_own": state_bytes(states[1], int(state_dst[0]))
                == state_bytes(states[1], int(state_slot[1][0])),
                "writes": {n: [m._pools[n].writes for m in mla] for n in ("swa", "mamba")},
            }
        ),
        flush=True,
    )


def faults(redis_url: str) -> None:
    """Faults are misses and Falses, never exceptions or wrong bytes: SGLang's failure
    injector around the backend; the node killed (the parent does it when this prints
    ``stored`` and answers with a line); an index that cannot be reached."""
    pool = make_host_pool("page_first")
    store = backend(config(redis_url, timeout=2.0), pool)
    keys = page_keys(500, 8)
    src = fill(pool, 8, 500)
    store.batch_set_v1(keys, src)
    injected = HiCacheStorageFailureInjector(store, 0.0, 0.5)
    seen = {"exists": set(), "got_ok": True, "calls": 0}
    for _ in range(40):
        dst = pool.alloc(8 * PAGE)
        res = injected.batch_get_v1(keys, dst)
        n = res.index(False) if False in res else len(res)
        seen["got_ok"] &= res == [True] * n + [False] * (8 - n) and same_pages(pool, src, dst, n)
        seen["exists"].add(injected.batch_exists(keys))
        seen["calls"] += 1
        pool.free(dst)
    print(json.dumps({"injected_exists": sorted(seen["exists"]), "injected_ok": seen["got_ok"]}))
    print("stored", flush=True)
    sys.stdin.readline()  # the parent killed the node
    t = time.monotonic()
    dst = pool.alloc(8 * PAGE)
    dead = {
        "got": store.batch_get_v1(keys, dst),
        "set": store.batch_set_v1(page_keys(501, 2), fill(pool, 2, 501)),
        "seconds": 0.0,
    }
    dead["seconds"] = time.monotonic() - t
    dead["failures"] = dict(store.failures)
    print(json.dumps(dead), flush=True)
    gone = backend(config("redis://127.0.0.1:1", timeout=1.0), make_host_pool("page_first"))
    t = time.monotonic()
    lost = {
        "exists": gone.batch_exists(keys),
        "got": gone.batch_get_v1(keys[:2], gone.pages.pool.alloc(2 * PAGE)),
        "set": gone.batch_set_v1(keys[:2], fill(gone.pages.pool, 2, 502)),
    }
    lost["seconds"] = time.monotonic() - t
    lost["failures"] = dict(gone.failures)
    print(json.dumps(lost), flush=True)


def main(argv: list[str]) -> int:
    """Runs the check ``argv`` names (the module docstring's lines, without the script):
    as a script, or in a fork of the SGLang zygote (tests/support/engine_zygote.py)."""
    what, url = argv[0], argv[1]
    if what == "layouts":
        layouts(url, argv[2] == "1")
    elif what == "ranks":
        ranks(url)
    elif what == "prefix":
        prefix_keys(url)
    elif what == "readme":
        readme(url, argv[2])
    elif what == "faults":
        faults(url)
    elif what == "hybrid":
        hybrid(url, argv[2] == "1")
    else:
        hybrid_vs_file(url)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
