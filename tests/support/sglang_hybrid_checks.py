"""The hybrid-model checks of tests/support/sglang_checks.py (its ``hybrid`` and
``hybrid_vs_file`` commands): a KV pool, a Mamba state pool and a sliding-window pool
registered as SGLang's hybrid cache controller hands them over."""

from __future__ import annotations

import json
import random
from typing import Any

from tests.support.sglang_site import define_torchvision_ops, make_host_pool, make_mamba_pool

define_torchvision_ops()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from tests.support.sglang_pools import (  # noqa: E402
    PAGE,
    backend,
    config,
    fill,
    page_keys,
    same_pages,
    state_bytes,
)


def hybrid(redis_url: str, same_host: bool) -> None:
    """A hybrid model's pools as SGLang's hybrid cache controller hands them over: the
    KV pool, a Mamba state pool and a sliding-window KV pool, registered through v2 (the
    names as SGLang's enums). A prompt of 8 pages: KV stored for every page (v1, as the
    base backup does), Mamba states at pages 3 and 7 (node ends, one key each), the
    window's 2 pages of sliding-window KV at pages 6 and 7 (v2). ``batch_exists_v2``
    applies each pool's hit policy; ``batch_get_v2`` lands each pool's pages in its own
    slots bit for bit; a state asked under another prompt's key is False."""
    extra = {} if same_host else {"same_host": False}
    kv, swa = make_host_pool("page_first", pages=40), make_host_pool("page_first", pages=40)
    mamba = make_mamba_pool(slots=16)
    store = backend(config(redis_url, model_name="tiny/hybrid", **extra), kv)
    for pool, name in ((kv, PoolName.KV), (mamba, PoolName.MAMBA), (swa, PoolName.SWA)):
        store.register_mem_host_pool_v2(pool, name)
    store.on_host_pools_registered()
    keys = page_keys(800 + same_host, 8)
    kv_slots, swa_slots = fill(kv, 8, 801), fill(swa, 2, 802)
    states = mamba.alloc(2)
    gen = torch.Generator().manual_seed(803)
    for buffer in (mamba.temporal_buffer, *mamba.conv_buffer):
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.dtype))
    stored = store.batch_set_v1(keys, kv_slots)
    sets = store.batch_set_v2(
        [
            PoolTransfer(PoolName.MAMBA, host_indices=states[:1], keys=[keys[3]]),
            PoolTransfer(PoolName.SWA, host_indices=swa_slots, keys=keys[6:8]),
        ]
    )
    sets2 = store.batch_set_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=states[1:], keys=[keys[7]])]
    )

    def exists(ask: list[str], *pools: tuple[Any, int]) -> dict:
        transfers = [
            PoolTransfer(name, keys=ask[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            for name, window in pools
        ]
        found = store.batch_exists_v2(ask, transfers)
        return {
            "kv": found.kv_hit_pages,
            "pools": {
                str(getattr(k, "value", k)): v for k, v in found.extra_pool_hit_pages.items()
            },
            "ends": found.restorable_prefix_pages,
        }

    all_pages = PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    new_states, new_swa = mamba.alloc(2), swa.alloc(2 * PAGE)
    got = store.batch_get_v2(
        [
            PoolTransfer(PoolName.MAMBA, host_indices=new_states[:1], keys=[keys[7]]),
            PoolTransfer(PoolName.SWA, host_indices=new_swa, keys=keys[6:8]),
        ]
    )
    other = page_keys(900, 1)
    print(
        json.dumps(
            {
                "stored": stored,
                "sets": sets,
                "sets2": sets2,
                "mamba_and_swa": exists(keys, (PoolName.MAMBA, 1), (PoolName.SWA, 2)),
                "mamba": exists(keys, (PoolName.MAMBA, 1)),
                "mamba_6": exists(keys[:6], (PoolName.MAMBA, 1)),
                "swa_all": store.batch_exists_v2(keys, [all_pages]).kv_hit_pages,
                "got": got,
                "same_state": state_bytes(mamba, int(new_states[0]))
                == state_bytes(mamba, int(states[1])),
                "same_swa": same_pages(swa, swa_slots, new_swa, 2),
                "other": store.batch_get_v2(
                    [PoolTransfer(PoolName.MAMBA, host_indices=new_states[1:], keys=other)]
                ),
                "namespaces": len({p.pages.namespace.digest_hex for p in store._pools.values()}),
                "failures": dict(store.failures),
            }
        ),
        flush=True,
    )


def hybrid_vs_file(redis_url: str) -> None:
    """kvstore's ``batch_exists_v2`` against SGLang's own file backend (``HiCacheFile``)
    as the reference: both attached to the same KV, Mamba and sliding-window pools,
    both given the same pages through ``batch_set_v2`` (KV for a random number of a
    prompt's first pages, Mamba states and window pages at random ones), both asked the
    same random pool transfers (Mamba trailing, window trailing over 1-3 pages, window
    all pages, none, several). Prints how many of the answers (the usable prefix, each
    pool's boundary, every restorable length) differ, and the first that does."""
    import tempfile

    kv, swa = make_host_pool("page_first", pages=40), make_host_pool("page_first", pages=40)
    mamba = make_mamba_pool(slots=40)
    ours = backend(config(redis_url, model_name="tiny/hybrid-vs-file"), kv)
    plain = config(redis_url)
    plain.extra_config = None
    reference = HiCacheFile(plain, file_path=tempfile.mkdtemp(prefix="hicache-file-"))
    reference.register_mem_pool_host(kv)
    for store in (ours, reference):
        for pool, name in ((kv, PoolName.KV), (mamba, PoolName.MAMBA), (swa, PoolName.SWA)):
            store.register_mem_host_pool_v2(pool, name)
        store.on_host_pools_registered()
    kv_slots, swa_slots, states = fill(kv, 10, 901), fill(swa, 10, 902), mamba.alloc(10)
    rng = random.Random(903)
    asked = differ = hits = gaps = 0  # hits, gaps: answers with a prefix, with holes
    first: dict = {}
    for case in range(24):
        keys = page_keys(1000 + case, 10)
        stored = rng.randrange(11)
        with_state = [p for p in range(10) if rng.random() < 0.4]
        with_window = [p for p in range(10) if rng.random() < 0.6]
        transfers = [
            PoolTransfer(PoolName.KV, host_indices=kv_slots[: stored * PAGE], keys=keys[:stored])
        ]
        transfers += [
            PoolTransfer(PoolName.MAMBA, host_indices=states[p : p + 1], keys=[keys[p]])
            for p in with_state
        ]
        transfers += [
            PoolTransfer(
                PoolName.SWA, host_indices=swa_slots[p * PAGE : (p + 1) * PAGE], keys=[keys[p]]
            )
            for p in with_window
        ]
        for store in (ours, reference):
            for transfer in transfers:
                store.batch_set_v2([transfer])
        for _ in range(4):
            window = rng.randint(1, 3)
            choices = [
                PoolTransfer(
                    PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES
                ),
                PoolTransfer(
                    PoolName.SWA, keys=keys[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES
                ),
                PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
            ]
            ask = rng.sample(choices, rng.randint(0, 2))
            answers = []
            for store in (ours, reference):
                got = store.batch_exists_v2(keys, ask)
                pools = {
                    str(getattr(k, "value", k)): v for k, v in got.extra_pool_hit_pages.items()
                }
                answers.append((got.kv_hit_pages, pools, list(got.restorable_prefix_pages or [])))
            asked += 1
            hits += answers[0][0] > 0
            ends = answers[0][2]
            gaps += ends != list(range(1, len(ends) + 1))
            if answers[0] != answers[1]:
                differ += 1
                first = first or {"case": case, "ours": answers[0], "file": answers[1]}
    print(
        json.dumps(
            {
                "asked": asked,
                "differ": differ,
                "first": first,
                "hits": hits,
                "gaps": gaps,
                "failures": dict(ours.failures),
            }
        ),
        flush=True,
    )
