"""Section 6 of the GPU check (bench/gpu_check.py): where a same-host device load's time
goes, a get timed along its way, the client's loop thread profiled, and the costs of the
loop itself and of the node over a raw socket."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bench.gpucheck.device import SIZES, Dev, interleave, stored_pages, whole
from bench.gpucheck.report import MiB, Report, rows


def get_marks(
    report: Report, dev: Dev, cluster: Any, args: argparse.Namespace, size: str
) -> tuple[Any, Any, Any, Any, Any]:
    """Same-host device gets of ``size`` pages, each timed along its way (medians, ms
    from the call: the first copies queued, the last part's copies and checks queued,
    its digests in, the call's return; through a plan also the request sent and the
    plan's first and last parts in); the client's event-loop thread profiled over one
    get (its 12 costliest functions by own time); and the get against the pinned copy
    reading the index's slots (the default, ``client.nodes.slot_reads``) and through the
    node's plan in parts of 32 and 64 MiB and in one (``shm_connection.PART_BYTES``),
    interleaved."""
    import client.nodes.shm_connection as shm_connection
    from client.memory.device_landing import CudaLanding, HostLanding
    from client.memory.device_pages import HostCopier
    from client.nodes.shm_connection import ShmConnection

    # without a GPU (a dry run of this code), the host as the device
    host = {} if dev.cuda else {"device": HostCopier}
    client, src, tokens, ns = stored_pages(cluster, dev, SIZES[size], args.total, **host)
    Landing = CudaLanding if dev.cuda else HostLanding
    n, nbytes = src.shape[0], src.numel() * src.element_size()
    rows_ = torch.empty((n, *ns.page_shape), dtype=ns.torch_dtype(), device=dev.device)
    got = client.get_found_device(client.find(tokens), rows_)
    if got != n * ns.block_size:  # say what the client counted before the rounds fail
        stats = client.stats
        report(
            f"  the first get of {n} pages got {got // ns.block_size}: find matched "
            f"{client.find(tokens).blocks}; checksum_failures {stats.checksum_failures}, "
            f"host_register_failures {stats.host_register_failures}, node_errors {stats.node_errors}"
        )
    marks: dict[str, list[float]] = {}
    now: dict[str, float] = {}
    per_part: list[float] = []  # the landing's add, per part
    spent: dict[str, float] = {}  # per get: time in the landing's adds, and their count
    patched: list[tuple[Any, str, Any]] = []

    def mark(name: str, first: bool = False) -> None:
        if first:
            now.setdefault(name, time.perf_counter())
        else:
            now[name] = time.perf_counter()

    def wrap(owner: Any, attr: str, before: str = "", after: str = "", first: bool = False) -> None:
        """Mark ``before`` and ``after`` each call of ``owner.attr`` (the first call's
        only, with ``first``)."""
        inner = getattr(owner, attr)
        if asyncio.iscoroutinefunction(inner):

            async def timed(*a: Any, **k: Any) -> Any:
                if before:
                    mark(before, first)
                out = await inner(*a, **k)
                if after:
                    mark(after, first)
                return out

        else:

            def timed(*a: Any, **k: Any) -> Any:  # type: ignore[misc]
                if before:
                    mark(before, first)
                out = inner(*a, **k)
                if after:
                    mark(after, first)
                return out

        patched.append((owner, attr, inner))
        setattr(owner, attr, timed)

    add = Landing.add

    def timed_add(self: Any, positions: Any, copies: Any) -> None:
        t = time.perf_counter()
        now.setdefault("first add starts", t)
        add(self, positions, copies)
        mark("last add done")
        spent["adds"] = spent.get("adds", 0.0) + now["last add done"] - t
        spent["parts"] = spent.get("parts", 0) + 1

    from client.gets.fetch import ReplicaFetcher
    from client.memory import device_landing
    from client.memory.device_pages import CudaCopier

    wrap(ReplicaFetcher, "fetch", "fetch starts (loop)", "fetch done")
    wrap(ShmConnection, "_get_device", "connection's get starts", "connection's get done")
    wrap(CudaCopier, "queue_copies", after="first copies queued", first=True)
    wrap(CudaCopier, "queue_segment", after="first copies queued", first=True)
    wrap(ShmConnection, "_ask", after="first frame sent", first=True)
    wrap(ShmConnection, "_plan_part", after="first part in", first=True)
    wrap(ShmConnection, "_plan_part", after="last part in")
    wrap(device_landing, "settled", "waiting for the device", "device done, loop woken")
    wrap(Landing, "digests", after="digests in")
    patched.append((Landing, "add", add))
    Landing.add = timed_add  # type: ignore[method-assign]
    try:
        for _ in range(args.rounds):
            found = client.find(tokens)
            now.clear()
            t0 = time.perf_counter()
            whole(client.get_found_device(found, rows_), src, ns.block_size)
            mark("returned")
            for name, at in sorted(now.items(), key=lambda kv: kv[1]):
                marks.setdefault(name, []).append(at - t0)
            per_part.append(spent.pop("adds", 0.0) / max(spent.pop("parts", 1), 1))
    finally:
        for owner, attr, inner in reversed(patched):
            setattr(owner, attr, inner)
    report(
        f"  {n} pages of {size} ({nbytes / MiB:.0f} MiB), ms from the call (medians of {args.rounds}; "
        f"slot reads {client.stats.slot_reads}, of them missed {client.stats.slot_read_misses}): "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in marks.items())
        + f"; an add (copies and checks queued) took {statistics.median(per_part) * 1e3:.3f} ms"
    )
    profile = cProfile.Profile()

    async def switch(on: bool) -> None:  # on the client's loop thread, where gets run
        (profile.enable if on else profile.disable)()

    found = client.find(tokens)
    client._run(switch(True))
    client.get_found_device(found, rows_)
    client._run(switch(False))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    report("  the client's loop thread over one get (cProfile, by own time):")
    for line in out.getvalue().splitlines():
        if line.strip() and not line.startswith(("   Ordered", "   List")):
            report(f"    {line.strip()[:150]}")
    pinned = dev.host((n, *ns.page_shape), ns.torch_dtype())
    chosen, slot_part = shm_connection.PART_BYTES, shm_connection.slot_part
    found_: list[Any] = [None]
    settled = device_landing.settled

    async def in_a_thread(done: Any, until: Any = None) -> None:  # as before BusPace
        await settled(done, None)

    def thread_waits() -> None:
        device_landing.settled = in_a_thread  # type: ignore[assignment]
        try:
            whole(client.get_found_device(found_[0], rows_), src, ns.block_size)
        finally:
            device_landing.settled = settled

    def parted(part_mib: int) -> Callable[[], None]:
        def run() -> None:
            shm_connection.PART_BYTES = part_mib << 20 if part_mib else 1 << 40
            shm_connection.slot_part = lambda *a: None  # type: ignore[assignment]
            try:
                whole(client.get_found_device(found_[0], rows_), src, ns.block_size)
            finally:
                shm_connection.PART_BYTES, shm_connection.slot_part = chosen, slot_part

        return run

    errors: dict[str, str] = {}
    times = interleave(
        {
            "pinned H2D of the same bytes (baseline)": lambda: rows_.copy_(
                pinned, non_blocking=True
            ),
            "get_found_device, index slots (default)": lambda: whole(
                client.get_found_device(found_[0], rows_), src, ns.block_size
            ),
            "get_found_device, index slots, waited in a thread": thread_waits,
        }
        | {
            f"get_found_device, plan in {f'parts of {m} MiB' if m else 'one'}": parted(m)
            for m in (32, 64, 0)
        },
        args.rounds,
        dev,
        errors,
        before=lambda: found_.__setitem__(0, client.find(tokens)),
    )
    rows(report, times, errors, nbytes)
    return client, src, tokens, ns, rows_


def loop_costs(report: Report, client: Any, tokens: list[int], ns: Any) -> None:
    """What a turn of the client's event loop costs (UCX progressed before each select)
    against a plain loop, UCX's progress and arm alone, and the node's own pace over a
    raw socket: a 1-page plan's round trip, and the gaps between the parts of a plan of
    128 pages in parts of 16."""
    import socket
    import threading

    from kvstore.pages._chainhash import split_hashes
    from kvstore.wire import loop_progress, shm
    from kvstore.wire import protocol as P

    async def turns(n: int = 2000) -> float:
        t = time.perf_counter()
        for _ in range(n):
            await asyncio.sleep(0)
        return (time.perf_counter() - t) / n

    async def nothing() -> None:
        pass

    hops = []
    for _ in range(500):
        t = time.perf_counter()
        client._run(nothing())
        hops.append(time.perf_counter() - t)
    report(
        f"  a sync call's hop to the client's loop and back: {statistics.median(hops) * 1e6:.0f} us (median of 500)"
    )
    ucx_turn = client._run(turns())
    plain: list[float] = []
    thread = threading.Thread(target=lambda: plain.append(asyncio.run(turns())))
    thread.start()
    thread.join()
    line = f"  a loop turn: the client's {ucx_turn * 1e6:.1f} us, a plain loop's {plain[0] * 1e6:.1f} us"
    progress = next(iter(loop_progress._by_loop.values()), None)
    if progress is not None:

        async def calls(n: int = 1000) -> tuple[float, float]:
            t = time.perf_counter()
            for _ in range(n):
                progress.worker.progress()
            t1 = time.perf_counter()
            for _ in range(n):
                progress.worker.arm()
            return (t1 - t) / n, (time.perf_counter() - t1) / n

        prog, arm = client._run(calls())
        line += f"; worker.progress() {prog * 1e6:.1f} us, worker.arm() {arm * 1e6:.1f} us"
    report(line)
    hashes = split_hashes(client.find(tokens).joined)
    path = next(c for c in client._async.nodes._conns.values() if c.path == "shm").node.extra["shm"]

    async def raw() -> tuple[list[float], list[list[float]]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        ch = shm.UnixChannel(sock)
        trips, gaps = [], []
        for k in range(12):
            one = P.GetRequest(
                namespace=ns.key.digest, tenant=ns.key.tenant, hashes=hashes[:1], join=[False]
            )
            t = time.perf_counter()
            await ch.send_frame(one)
            _, fds = await ch.recv_frame()
            trips.append(time.perf_counter() - t)
            shm.close_fds(fds)
            await ch.send_frame(P.GetDone())
            parted = P.GetRequest(
                namespace=ns.key.digest,
                tenant=ns.key.tenant,
                hashes=hashes,
                join=[False] * len(hashes),
                part_pages=16,
            )
            t = time.perf_counter()
            await ch.send_frame(parted)
            at = []
            while True:
                raw_, fds = await ch.recv_frame()
                at.append(time.perf_counter() - t)
                shm.close_fds(fds)
                if not P.decode(raw_).more:
                    break
            await ch.send_frame(P.GetDone())
            if k >= 2:
                gaps.append(at)
            await asyncio.sleep(0.002)
        ch.close()
        return trips[2:], gaps

    trips, parts = asyncio.run(raw())
    firsts = [p[0] for p in parts]
    gaps_ = [b - a for p in parts for a, b in zip(p, p[1:])]
    report(
        f"  the node over a raw socket (plain loop): 1-page plan round trip {statistics.median(trips) * 1e3:.2f} ms; "
        f"{len(hashes)} pages in parts of 16: first part {statistics.median(firsts) * 1e3:.2f} ms, "
        f"then one every {statistics.median(gaps_ or [0]) * 1e3:.2f} ms (median), all in {statistics.median(p[-1] for p in parts) * 1e3:.2f} ms"
    )


def section_breakdown(report: Report, dev: Dev, cluster: Any, args: argparse.Namespace) -> None:
    """Where a same-host device load spends its time, for 64 KiB, 16 MiB and 2 MiB pages
    (``get_marks``); and for 2 MiB pages the copy engine's rate from the node's
    registered slabs alone, and the checks alone in one launch and in batches, against
    the pinned copy."""
    from client.memory.copy_plans import CHECK_BATCH
    from kvstore.pages import device_checksum

    get_marks(report, dev, cluster, args, "64 KiB")[0].close()
    get_marks(report, dev, cluster, args, "16 MiB")[0].close()  # checked in 2 MiB segments
    client, src, tokens, ns, rows_ = get_marks(report, dev, cluster, args, "2 MiB")
    loop_costs(report, client, tokens, ns)
    n = src.shape[0]
    conn = next(c for c in client._async.nodes._conns.values() if c.path == "shm")
    maps = [
        (r, m) for r, m in conn._maps.items() if conn._slabs.registered.get(r) is not None
    ]  # what gets copy from
    total = sum(m.nbytes for _, m in maps)
    dst = torch.empty(total, dtype=torch.uint8, device=dev.device)
    pinned = dev.host((total,), torch.uint8)

    def slabs() -> None:
        at = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mappings, only read
            for _, m in maps:
                dst[at : at + m.nbytes].copy_(torch.from_numpy(m), non_blocking=True)
                at += m.nbytes

    flat = rows_.view(-1).view(torch.uint8)
    offs = [i * ns.page_nbytes for i in range(n)]
    per = max(1, CHECK_BATCH // ns.page_nbytes)

    def batched() -> None:
        accs = [
            device_checksum.launch(flat, offs[k : k + per], ns.page_nbytes)
            for k in range(0, n, per)
        ]
        for a in accs:
            device_checksum.finish(a, ns.page_nbytes)

    errors: dict[str, str] = {}
    times = interleave(
        {
            "pinned H2D of the same bytes (baseline)": lambda: dst.copy_(pinned, non_blocking=True),
            f"H2D from the node's {len(maps)} registered slabs, one copy each": slabs,
            "device xxh3 of the pages, one launch": lambda: device_checksum.checksums(
                flat, offs, ns.page_nbytes
            ),
            f"device xxh3 in batches of {per} pages": batched,
        },
        args.rounds,
        dev,
        errors,
    )
    rows(report, times, errors, total)
    client.close()
