"""Section 6 of bench/events.py (``--auth-only``), its second half: two real node
processes publishing events, one open, one authenticated: their CPU over idle windows,
an idle publisher thread's CPU, and puts whose events a subscriber reads."""

from __future__ import annotations

import os
import sys
import time

from bench.benchcommon.proc import cpu_seconds
from bench.kvevents.auth_rates import AUTH_HEADER, AUTH_TENANT, RouterKeys, auth_row, interleaved
from bench.kvevents.common import cpu_ns, events_namespace
from kvstore import events as ev
from kvstore.tools.procutil import free_port


def _grown(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(v - before.get(tid, 0) for tid, v in after.items())


def _read_put(sock, blocks: int, timeout: float = 5.0) -> bool:
    """Whether ``blocks`` stored block hashes arrive on ``sock`` within ``timeout``."""
    decoder = ev.decoder()
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < blocks:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            return False
        _, _, payload = sock.recv_multipart()
        seen += sum(
            len(e.block_hashes)
            for e in decoder.decode(payload).events
            if isinstance(e, ev.BlockStored) and e.medium == ev.MEDIUM_CPU
        )
    return True


def bench_auth_node(rounds: int, idle_s: float, put_rounds: int) -> None:
    """Two real node processes (each with its own Valkey, anonymous), both publishing
    events: one open with a plain SUB connected, one authenticated (routers file and
    key file) with a router connected, so its XPUB, ZAP handler and monitors are live.
    Idle CPU of both over the same windows; then puts of 32 pages of 256 KiB to each in
    turn (interleaved), every put's events read by the subscriber."""

    import torch
    import zmq

    from client import KVCacheClient
    from kvstore.tools.launcher import LocalCluster

    keys = RouterKeys(AUTH_TENANT)
    p_off, p_on = free_port(), free_port()
    clusters = {
        "off": LocalCluster(
            1, "256MiB", slab_size="16MiB", extra_args=["--kv-events-endpoint", f"tcp://*:{p_off}"]
        ),
        "on": LocalCluster(
            1,
            "256MiB",
            slab_size="16MiB",
            extra_args=[
                "--kv-events-endpoint",
                f"tcp://*:{p_on}",
                "--kv-events-routers-file",
                keys.routers,
                "--kv-events-key-file",
                keys.node_secret,
            ],
        ),
    }
    ctx = zmq.Context()
    # the publisher alone, in this process: its thread's CPU while idle, open and authenticated
    alone = {
        "off": ev.EventPublisher(ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", mode="bind")),
        "on": ev.EventPublisher(
            ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", mode="bind"), keys.access("bench")
        ),
    }
    socks = []
    try:
        for c in clusters.values():
            c.start()
        plain = ctx.socket(zmq.SUB)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(f"tcp://127.0.0.1:{p_off}")
        subs = {"off": plain, "on": keys.router_socket(ctx, f"tcp://127.0.0.1:{p_on}")}
        socks = [plain, subs["on"]]
        for side, pub in alone.items():
            sock = keys.router_socket(ctx, pub.endpoint) if side == "on" else ctx.socket(zmq.SUB)
            if side == "off":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(pub.endpoint)
            socks.append(sock)
        pids = {side: c.nodes[0].process.pid for side, c in clusters.items()}
        ns = events_namespace(AUTH_TENANT)
        clients = {side: KVCacheClient(c.redis_url, ns) for side, c in clusters.items()}
        time.sleep(1)  # the subscriptions reach the nodes (ZMQ's slow joiner)
        # a put to each: the subscriptions are live before the idle windows (the router's was granted)
        for i, side in enumerate(("off", "on")):
            tokens = list(range(10**8 + i * 10**6, 10**8 + i * 10**6 + 32 * ns.block_size))
            assert (
                clients[side]
                .put_pages(tokens, torch.randn((32, *ns.page_shape), dtype=torch.float16))
                .stored
                == 32
            )
            if not _read_put(subs[side], 32):
                print(
                    f"WARNING: the subscriber of the node with authentication {side} did not get the warm-up put's events",
                    file=sys.stderr,
                )
        time.sleep(2)

        # idle: both nodes over the same windows
        idle_ns: dict[str, list[float]] = {"off": [], "on": []}
        idle_ticks: dict[str, list[float]] = {"off": [], "on": []}
        thread_us: dict[str, list[float]] = {"off": [], "on": []}
        tids = {side: [pub._thread.native_id] for side, pub in alone.items()}
        for r in range(rounds):
            before = {side: (cpu_ns(pid), cpu_seconds(pid)) for side, pid in pids.items()}
            thread_before = {side: cpu_ns(os.getpid(), tids[side]) for side in alone}
            t0 = time.monotonic()
            time.sleep(idle_s)
            seconds = time.monotonic() - t0
            for side, pid in pids.items():
                idle_ns[side].append(100 * _grown(before[side][0], cpu_ns(pid)) / 1e9 / seconds)
                idle_ticks[side].append(100 * (cpu_seconds(pid) - before[side][1]) / seconds)
                thread_us[side].append(
                    _grown(thread_before[side], cpu_ns(os.getpid(), tids[side])) / 1e3 / seconds
                )
            print(
                f"idle round {r}: node off {idle_ns['off'][-1]:.3f} %, on {idle_ns['on'][-1]:.3f} %; "
                f"publisher thread off {thread_us['off'][-1]:.1f} µs/s, on {thread_us['on'][-1]:.1f} µs/s",
                file=sys.stderr,
                flush=True,
            )

        # puts, interleaved, each put's events read by the router before the next put
        put_ms: dict[str, list[float]] = {"off": [], "on": []}
        delivered = {"off": 0, "on": 0}
        for r, side in interleaved(put_rounds):
            tokens = list(
                range(
                    r * 10**6 + (side == "on") * 500_000,
                    r * 10**6 + (side == "on") * 500_000 + 32 * ns.block_size,
                )
            )
            pages = torch.randn((32, *ns.page_shape), dtype=torch.float16)
            t0 = time.perf_counter()
            assert clients[side].put_pages(tokens, pages).stored == 32
            put_ms[side].append(1000 * (time.perf_counter() - t0))
            delivered[side] += _read_put(subs[side], 32)
        for c in clients.values():
            c.close()

        print(
            f"\n### Authentication on and off: a real node ({rounds} idle windows of {idle_s:.0f} s, {put_rounds} puts each)\n"
        )
        print(
            "Two node processes publishing events, each with its own Valkey: off, an open PUB with a plain SUB connected; "
            f"on, a routers file and a key file, with a router reading tenant {AUTH_TENANT} connected (its XPUB, ZAP handler and "
            "monitors live). Both idle over the same windows; then puts of 32 pages of 256 KiB (tenant "
            f"{AUTH_TENANT}) to each in turn, off/on and on/off alternating, every put's events read before the next.\n"
        )
        print(AUTH_HEADER.format(what="figure", extra="note"))
        print(
            auth_row(
                "node idle, % of a core (schedstat, ns)",
                idle_ns["off"],
                idle_ns["on"],
                lambda v: f"{v:.3f}",
            )
        )
        ticks = [
            round(v * idle_s) for v in idle_ticks["off"] + idle_ticks["on"]
        ]  # % of a core over idle_s s, in 10 ms ticks
        print(
            auth_row(
                "node idle, % of a core (clock ticks, 10 ms)",
                idle_ticks["off"],
                idle_ticks["on"],
                lambda v: f"{v:.2f}",
                f"{min(ticks)}–{max(ticks)} ticks per window: too coarse for a ratio",
            )
        )
        print(
            auth_row(
                "the publisher thread alone, idle, µs of CPU per second",
                thread_us["off"],
                thread_us["on"],
                lambda v: f"{v:.1f}",
                "on: a wake-up a second to re-check the routers file",
            )
        )
        print(
            auth_row(
                "put of 32 pages of 256 KiB, ms",
                put_ms["off"],
                put_ms["on"],
                lambda v: f"{v:.2f}",
                f"puts whose 32 blocks reached the subscriber: off {delivered['off']}/{put_rounds}, on {delivered['on']}/{put_rounds}",
            )
        )
    finally:
        for sock in socks:
            sock.close(linger=0)
        for pub in alone.values():
            pub.close()
        ctx.term()
        for c in clusters.values():
            c.stop()
        keys.close()
