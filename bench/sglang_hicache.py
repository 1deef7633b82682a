"""kvstore and Mooncake Store as SGLang HiCache L3 backends, side by side in one run,
through SGLang's own interface on one SGLang host pool.

    python -m venv /tmp/mooncake-venv        # as for bench/vs_mooncake.py
    /tmp/mooncake-venv/bin/pip install mooncake-transfer-engine==0.3.7 nvidia-cuda-runtime-cu12 numpy
    .venv/bin/python bench/sglang_hicache.py --mooncake-site /tmp/mooncake-venv/lib/python3.11/site-packages

SGLang 0.5.23 is the one .ci/run installs beside the venv (.venv/sglang-site). Both
backends are built as SGLang builds them: kvstore's ``KVStoreHiCache`` by SGLang's
``dynamic`` factory with ``interface_v1`` (one storage node, same host: shared
memory), Mooncake's ``MooncakeStore`` (SGLang's own backend for it) with its master
on loopback and the global segment mounted in this process, as SGLang's docs run it,
over its TCP transport (no RDMA NIC here). They share one host pool
(``MHATokenToKVPoolHost``, layout page_first): Llama-3.1-8B's KV, 32 layers x 8 KV
heads x 128 in bf16, 16 tokens a page, 2 MiB a page.

Each round, for each size and backend in turn (A B A B), after SETTLE_S of quiet:
``batch_set_v1`` of fresh pages in batches of 128 (SGLang's backup thread), then
``batch_exists`` of their keys in batches of 128 as SGLang's prefetch asks (stopping
at the first short batch), then ``batch_get_v1`` into other slots, checked byte for
byte. Calls carry no prefix keys, as README deploys SGLang (both backends ignore
them). Lookups of 8,192 pages use a
second pool of 1-token pages (128 KiB: the lookup's work does not grow with the
page). Each store has room for about a round (below, at ``big_room``). Printed:
medians and min-max, in GB/s for sets and gets and in ms for lookups, each as a ratio
to Mooncake's figure (above 1: kvstore faster)."""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "sglang-site"
SETTLE_S = 0.25  # as bench/vs_mooncake.py: each operation starts on a quiet machine
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
MOONCAKE_LEASE_S = 6  # Mooncake 0.3.7's default lease on what a get read: 5 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reexec(mooncake_site: str) -> None:
    """Run this file again with SGLang, Triton and Mooncake's packages on the path
    (after this venv's own, so Mooncake's virtualenv shadows nothing)."""
    cudart = Path(mooncake_site) / "nvidia" / "cuda_runtime" / "lib"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE), str(ROOT / ".venv" / "triton-site")]),
        "KVSTORE_BENCH_MOONCAKE_SITE": mooncake_site,
        "LD_LIBRARY_PATH": f"{cudart}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "GLOG_minloglevel": "2",
    }
    sys.exit(subprocess.call([sys.executable, __file__, *sys.argv[1:]], env=env))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake-site", default=os.environ.get("MOONCAKE_SITE"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="128,1024", help="pages per set/get (2 MiB each)")
    ap.add_argument("--lookup-pages", type=int, default=8192)
    args = ap.parse_args()
    if not args.mooncake_site:
        sys.exit("--mooncake-site is required (see the first lines of this file)")
    if "KVSTORE_BENCH_MOONCAKE_SITE" not in os.environ:
        reexec(args.mooncake_site)
    sys.path.append(os.environ["KVSTORE_BENCH_MOONCAKE_SITE"])

    from tests.support.sglang_site import define_torchvision_ops, make_host_pool

    define_torchvision_ops()
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvstore.tools.launcher import LocalCluster

    sizes = [int(s) for s in args.sizes.split(",")]
    page = 16
    geometry = {"layers": 32, "heads": 8, "head_dim": 128, "dtype": torch.bfloat16}
    big = 2 * max(sizes)
    pool = make_host_pool("page_first", page_size=page, pages=big, device_pages=4, **geometry)
    small = make_host_pool(
        "page_first", page_size=1, pages=args.lookup_pages, device_pages=4, **geometry
    )
    page_bytes = pool.get_dummy_flat_data_page().nbytes
    small_page = small.get_dummy_flat_data_page().nbytes
    pool.kv_buffer.view(torch.int16).random_()
    small.kv_buffer.view(torch.int16).random_()
    # Room for one round of every size and the lookups' pages, below each store's
    # eviction mark: the 24 GiB of this machine hold the host pools and both stores (a
    # room for every round was killed for memory). kvstore's node evicts earlier rounds'
    # pages by itself, inside the timings; Mooncake's segment is emptied of each round's
    # pages after it, outside them, once the leases its gets took ran out (left to
    # itself, a full segment evicted the pages just put, which hold no lease, and their
    # lookups and gets failed). Neither store's eviction sees lookups, which read no
    # page, so the lookups' pages are stored again (outside the timings) before them.
    big_room = sum(sizes) * page_bytes * 5 // 4
    small_room = args.lookup_pages * small_page * 5 // 4
    # kvstore's node: two rounds and the lookups' pages
    node_room = 2 * big_room + small_room

    mc_package = Path(os.environ["KVSTORE_BENCH_MOONCAKE_SITE"]) / "mooncake"
    rpc, http = free_port(), free_port()
    master = subprocess.Popen(
        [
            str(mc_package / "mooncake_master"),
            f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.5)

    def config(extra: dict, model: str) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=model, extra_config=extra,
        )  # fmt: skip

    def build(name: str, cluster_url: str, host_pool, model: str, segment: int):
        if name == "mooncake":
            extra = {
                "master_server_address": f"127.0.0.1:{rpc}",
                "metadata_server": f"http://127.0.0.1:{http}/metadata",
                "protocol": "tcp",
                "device_name": "",
                "local_hostname": "127.0.0.1",
                "global_segment_size": -(-segment // 2**30) << 30,
                "check_server": False,
            }
            made = StorageBackendFactory.create_backend("mooncake", config(extra, model), host_pool)
        else:
            extra = {
                "backend_name": "kvstore",
                "module_path": "client.sglang",
                "class_name": "KVStoreHiCache",
                "interface_v1": 1,
                "redis_url": cluster_url,
                "tenant": "bench",
            }
            made = StorageBackendFactory.create_backend("dynamic", config(extra, model), host_pool)
        made.register_mem_pool_host(host_pool)
        return made

    def keys_for(seed: int, count: int, page_size: int) -> list[str]:
        rng = random.Random(seed)
        tokens = [rng.randrange(128_000) for _ in range(count * page_size)]
        return get_storage_hash_str(tokens, None, page_size=page_size)

    def info(keys, at: int, placed: bool):
        """SGLang's extra info of a batch from ``at``: the keys before it when the
        deployment passes them (hicache_storage_pass_prefix_keys)."""
        return HiCacheStorageExtraInfo(prefix_keys=keys[:at] if placed else None)

    def batched(call, keys, slots, page_size, placed) -> list[bool]:
        out: list[bool] = []
        for i in range(0, len(keys), BATCH):
            part = keys[i : i + BATCH]
            out += call(
                part, slots[i * page_size : (i + len(part)) * page_size], info(keys, i, placed)
            )
        return out

    def exists(backend, keys, placed) -> int:
        hit = 0
        for i in range(0, len(keys), BATCH):
            part = keys[i : i + BATCH]
            n = backend.batch_exists(part, info(keys, i, placed))
            hit += n
            if n < len(part):
                break
        return hit

    times: dict[tuple[str, str, int], list[float]] = {}
    failed: list[str] = []
    names = ("mooncake", "kvstore")
    placed = {n: False for n in names}  # as README deploys SGLang: no prefix keys
    try:
        with LocalCluster(1, f"{-(-node_room // 2**30)}GiB", slab_size="64MiB") as cluster:
            kinds = {n: n.split(",")[0] for n in names}
            backends = {
                n: build(kinds[n], cluster.redis_url, pool, "bench/llama-8b", big_room)
                for n in names
            }
            smalls = {
                n: build(kinds[n], cluster.redis_url, small, f"bench/llama-8b-1tok-{k}", small_room)
                for k, n in enumerate(names)
            }
            src = torch.arange(big * page, dtype=torch.int64)[: max(sizes) * page]
            dst = torch.arange(big * page, dtype=torch.int64)[max(sizes) * page :]
            lookup_keys = keys_for(999, args.lookup_pages, 1)
            lookup_slots = torch.arange(args.lookup_pages, dtype=torch.int64)
            for n in names:  # the lookups' pages, stored once
                if not all(
                    batched(smalls[n].batch_set_v1, lookup_keys, lookup_slots, 1, placed[n])
                ):
                    failed.append(f"{n} set of the lookup pages")
            time.sleep(3)  # the client's buffers faulted in; let the kernel settle
            for r in range(-1, args.rounds):  # round -1 warms up, unrecorded
                for size in sizes:
                    for k, n in enumerate(names):
                        b = backends[n]
                        keys = keys_for(1000 * (r + 2) + 10 * size + k, size, page)
                        s_slots, d_slots = src[: size * page], dst[: size * page]
                        pool.kv_buffer[:, max(sizes) * page :].view(torch.int16).numpy().fill(0)
                        for op in ("set", "exists", "get"):
                            time.sleep(SETTLE_S)
                            t = time.perf_counter()
                            if op == "set":
                                good = all(batched(b.batch_set_v1, keys, s_slots, page, placed[n]))
                            elif op == "exists":
                                good = exists(b, keys, placed[n]) == size
                            else:
                                good = all(batched(b.batch_get_v1, keys, d_slots, page, placed[n]))
                            seconds = time.perf_counter() - t
                            if op == "get":
                                got = pool.kv_buffer[
                                    :, max(sizes) * page : (max(sizes) + size) * page
                                ]
                                good = good and torch.equal(
                                    got.view(torch.int16),
                                    pool.kv_buffer[:, : size * page].view(torch.int16),
                                )
                            if not good:
                                failed.append(f"{n} {op} {size} round {r}")
                            if r >= 0:
                                times.setdefault((n, op, size), []).append(seconds)
                time.sleep(MOONCAKE_LEASE_S)  # its gets' leases run out, then its pages go
                backends["mooncake"].store.remove_by_regex("^bench-llama-8b_")
                for n in names:  # the lookups' pages, evicted or not, stored again
                    if not all(
                        batched(smalls[n].batch_set_v1, lookup_keys, lookup_slots, 1, placed[n])
                    ):
                        failed.append(f"{n} set of the lookup pages, round {r}")
                for n in names:  # lookups of the long prompt
                    time.sleep(SETTLE_S)
                    t = time.perf_counter()
                    good = exists(smalls[n], lookup_keys, placed[n]) == args.lookup_pages
                    seconds = time.perf_counter() - t
                    if not good:
                        failed.append(f"{n} exists {args.lookup_pages} round {r}")
                    if r >= 0:
                        times.setdefault((n, "exists", args.lookup_pages), []).append(seconds)
            for b in (*backends.values(), *smalls.values()):
                b.close()
    finally:
        master.kill()
        master.wait()

    print(
        f"# SGLang 0.5.23 HiCache L3 backends through its interface, one host pool "
        f"(page_first, {page_bytes >> 20} MiB pages of 16 tokens), {args.rounds} rounds "
        f"interleaved, batches of {BATCH}, {os.cpu_count()} cores; Mooncake 0.3.7 (TCP)"
    )
    print("| op | pages | " + " | ".join(names) + " | ratios to Mooncake (>1: faster) |")
    print("|---|---|" + "---|" * (len(names) + 1))
    rows = [(op, s) for s in sizes for op in ("set", "get")]
    rows += [("exists", s) for s in (*sizes, args.lookup_pages)]
    for op, size in rows:
        cells = []
        meds = {}
        for n in names:
            ts = times.get((n, op, size))
            if ts is None:
                cells.append("-")
                continue
            med = statistics.median(ts)
            meds[n] = med
            if op == "exists":
                cells.append(f"{med * 1e3:.2f} ms ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})")
            else:
                gb = size * page_bytes / 1e9
                cells.append(f"{gb / med:.2f} GB/s ({gb / max(ts):.2f}-{gb / min(ts):.2f})")
        ratios = ", ".join(f"{meds['mooncake'] / meds[n]:.2f}x" for n in names[1:] if n in meds)
        print(f"| {op} | {size} | " + " | ".join(cells) + f" | {ratios} |")
    print(
        "every set stored, every get read back byte-identical: "
        + ("yes" if not failed else "NO: " + ", ".join(failed))
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
