"""Storage nodes as real processes, real UCX on loopback, clients in other processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvstore import block_hashes
from kvstore.index import PageIndex
from kvstore.pages.checksum import page_checksum
from kvstore.wire import protocol as P
from tests.helpers import (
    ROOT,
    advertised_prefix,
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
    worker_result,
)


@pytest.mark.parametrize("page_size", [4 << 10, 64 << 10, 2 << 20, 8 << 20])
def test_put_then_get_from_another_process_is_bit_exact(clusters, page_size):
    cluster = clusters()
    ns = namespace_for_page_size(page_size, tenant=f"exact-{page_size}")
    count = ns.block_size * 6
    put = run_worker(spec(cluster, ns, "put_pages", count=count))
    assert put["reports"][0]["stored"] == 6 and put["reports"][0]["sent"] == 6
    got = run_worker(spec(cluster, ns, "get_pages", count=count))
    assert got["results"] == [{"blocks": 6, "matched": 6, "exact": True}]
    assert got["stats"]["direct_transfers"] == 1


# The tests whose node behaviour goes through the index (commit, eviction under read
# leases, deregistration) run on a single Valkey and on a 3-shard Valkey cluster.
ON_BOTH_INDEXES = pytest.mark.parametrize("index_shards", [1, 3], ids=["valkey", "cluster3"])


def test_batch_of_1024_small_pages_moves_in_few_messages(clusters):
    cluster = clusters()
    ns = namespace_for_page_size(4 << 10, tenant="batch")
    count = ns.block_size * 1024
    put = run_worker(spec(cluster, ns, "put_pages", count=count))
    assert put["reports"][0]["stored"] == 1024
    got = run_worker(spec(cluster, ns, "get_pages", count=count))
    assert got["results"] == [{"blocks": 1024, "matched": 1024, "exact": True}]
    m = metrics(cluster, "node-0")
    assert m['kvstore_payload_messages_total{direction="in"}'] <= 4
    assert m['kvstore_payload_messages_total{direction="out"}'] <= 4
    assert m["kvstore_put_pages_total"] == 1024 and m["kvstore_get_pages_total"] == 1024


def test_large_scattered_pages_share_ucx_messages(clusters):
    """A layer-major paged cache's blocks are scattered (a piece per layer) and land
    through a scratch buffer over UCX, so large ones share messages as small ones do: a
    load of a dozen 512 KiB blocks into every other block is one message, not twelve,
    and every byte lands in its block."""
    import torch

    from client import KVCacheClient
    from client.paging.paged_cache import PagedCache
    from kvstore import Namespace

    cluster = clusters()
    ns = Namespace(
        model="scattered",
        dtype="float32",
        num_layers=4,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        tenant="scattered",
        layout="vllm_cpu",
    )
    assert ns.page_nbytes > P.PACK_BELOW
    n = 12
    tokens = list(range(n * ns.block_size))
    pages = torch.randn(n, *ns.page_shape)
    cache = PagedCache([torch.zeros((2 * n + 2, *ns.page_shape[1:])) for _ in range(ns.num_layers)])
    blocks = list(range(1, 2 * n + 1, 2))
    sent = 'kvstore_payload_messages_total{direction="out"}'
    with KVCacheClient(cluster.redis_url, ns, same_host=False) as client:
        assert client.put_pages(tokens, pages).stored == n
        before = metrics(cluster, "node-0").get(sent, 0)
        spans = cache.block_spans(blocks)
        assert all(s.pieces for s in spans)
        assert client.get_found_into(client.find(tokens), spans) == len(tokens)
    assert metrics(cluster, "node-0")[sent] - before == 1
    assert torch.equal(cache.gather(blocks).wait(), pages)


@ON_BOTH_INDEXES
def test_filling_past_capacity_evicts_least_recently_used(clusters):
    cluster = clusters(capacity="8MiB", slab="1MiB")
    ns = namespace_for_page_size(64 << 10, tenant="evict")
    batches = [list(range(b * 10_000, b * 10_000 + 32 * ns.block_size)) for b in range(4)]
    opts = {"lease_ms": 0}
    for b in batches[:3]:
        assert (
            run_worker(spec(cluster, ns, "put_pages", tokens=b, options=opts))["reports"][0][
                "stored"
            ]
            == 32
        )
    # reading batch 0 makes it recently used, so batch 1 is now the oldest
    assert (
        run_worker(spec(cluster, ns, "get_pages", tokens=batches[0], options=opts))["results"][0][
            "matched"
        ]
        == 32
    )
    assert (
        run_worker(spec(cluster, ns, "put_pages", tokens=batches[3], options=opts))["reports"][0][
            "stored"
        ]
        == 32
    )
    index = PageIndex(cluster.redis_url)
    prefixes = [advertised_prefix(index, ns, block_hashes(ns, b), lease_ms=0) for b in batches]
    assert prefixes[0] == 32 and prefixes[1] == 0 and prefixes[2] == 32 and prefixes[3] == 32
    # whatever the index shows is really there, byte for byte
    got = run_worker(spec(cluster, ns, "get_pages", token_lists=batches, options=opts))["results"]
    assert [r["matched"] for r in got] == prefixes and all(r["exact"] for r in got)
    m = metrics(cluster, "node-0")
    assert m["kvstore_used_bytes"] <= m["kvstore_capacity_bytes"] == 8 << 20
    assert m["kvstore_evicted_pages_total"] >= 24


@ON_BOTH_INDEXES
def test_put_that_cannot_fit_is_refused_cleanly(clusters):
    cluster = clusters(capacity="2MiB", slab="1MiB")
    ns = namespace_for_page_size(64 << 10, tenant="refuse")
    first = list(range(32 * ns.block_size))
    assert run_worker(spec(cluster, ns, "put_pages", tokens=first))["reports"][0]["stored"] == 32
    PageIndex(cluster.redis_url).lookup(
        ns, block_hashes(ns, first), lease_ms=60_000
    )  # readers hold every page
    second = list(range(50_000, 50_000 + 8 * ns.block_size))
    report = run_worker(spec(cluster, ns, "put_pages", tokens=second))["reports"][0]
    assert report["stored"] == 0 and report["refused"] == 8
    assert run_worker(spec(cluster, ns, "get_pages", tokens=first))["results"] == [
        {"blocks": 32, "matched": 32, "exact": True}
    ]
    assert metrics(cluster, "node-0")["kvstore_refused_pages_total"] == 8


@ON_BOTH_INDEXES
def test_four_concurrent_clients_read_only_correct_bytes(clusters):
    cluster = clusters(servers=2)
    ns = namespace_for_page_size(64 << 10, tenant="concurrent")
    common = list(range(8 * ns.block_size))
    lists = [
        common + list(range(100_000 * (w + 1), 100_000 * (w + 1) + 8 * ns.block_size))
        for w in range(4)
    ]
    procs = [
        run_worker(
            spec(cluster, ns, "put_pages", token_lists=[lists[w], lists[(w + 1) % 4]]),
            background=True,
        )
        for w in range(4)
    ]
    procs += [
        run_worker(
            spec(cluster, ns, "get_pages", token_lists=lists, loop_seconds=2), background=True
        )
        for _ in range(2)
    ]
    results = [worker_result(p) for p in procs]
    for r in results[4:]:
        assert all(x["exact"] for x in r["results"])
    final = run_worker(spec(cluster, ns, "get_pages", token_lists=lists))["results"]
    assert final == [{"blocks": 16, "matched": 16, "exact": True}] * 4


def _put_in_progress(cluster) -> bool:
    try:
        return metrics(cluster, "node-0")["kvstore_pinned_pages"] > 0
    except (StopIteration, OSError):
        return False


@ON_BOTH_INDEXES
def test_client_killed_mid_put_leaves_nothing_visible(clusters):
    cluster = clusters(capacity="1GiB", slab="16MiB")
    ns = namespace_for_page_size(2 << 20, tenant="kill-client")
    tokens = list(range(192 * ns.block_size))
    proc = run_worker(spec(cluster, ns, "put_pages", tokens=tokens), background=True)
    wait_for(lambda: _put_in_progress(cluster) or proc.poll() is not None, 60, "the put to start")
    proc.kill()
    proc.wait()
    index = PageIndex(cluster.redis_url)
    time.sleep(0.5)
    assert advertised_prefix(index, ns, block_hashes(ns, tokens), lease_ms=0) == 0
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_used_bytes"] == 0,
        20,
        "slots of the broken put to be freed",
    )
    assert metrics(cluster, "node-0")["kvstore_pinned_pages"] == 0
    small = namespace_for_page_size(64 << 10, tenant="after-kill")
    assert (
        run_worker(spec(cluster, small, "put_pages", count=4 * small.block_size))["reports"][0][
            "stored"
        ]
        == 4
    )


def test_server_killed_mid_put_gives_client_an_error_in_time(clusters):
    cluster = clusters(capacity="1GiB", slab="16MiB")
    ns = namespace_for_page_size(2 << 20, tenant="kill-server-put")
    tokens = list(range(192 * ns.block_size))
    proc = run_worker(
        spec(cluster, ns, "put_pages", tokens=tokens, options={"timeout": 3}), background=True
    )
    wait_for(lambda: _put_in_progress(cluster) or proc.poll() is not None, 60, "the put to start")
    cluster.nodes[0].kill()
    result = worker_result(proc, timeout=60)
    assert result["reports"][0]["stored"] == 0
    assert result["stats"]["node_errors"] >= 1
    assert (
        advertised_prefix(PageIndex(cluster.redis_url), ns, block_hashes(ns, tokens), lease_ms=0)
        == 0
    )


def test_server_killed_mid_get_gives_miss_never_wrong_bytes(clusters):
    cluster = clusters(capacity="1GiB", slab="16MiB")
    ns = namespace_for_page_size(2 << 20, tenant="kill-server-get")
    tokens = list(range(128 * ns.block_size))
    assert run_worker(spec(cluster, ns, "put_pages", tokens=tokens))["reports"][0]["stored"] == 128
    proc = run_worker(
        spec(cluster, ns, "get_pages", tokens=tokens, loop_seconds=8, options={"timeout": 2}),
        background=True,
    )
    # kill once the node has served at least one whole get and is serving more
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_get_pages_total"] >= 129,
        60,
        "the reader to get going",
    )
    cluster.nodes[0].kill()
    start = time.monotonic()
    result = worker_result(proc, timeout=60)
    assert time.monotonic() - start < 20
    outcomes = result["results"]
    assert all(r["exact"] for r in outcomes)
    assert outcomes[0]["matched"] == 128
    assert outcomes[-1]["matched"] < 128


def test_garbage_and_truncated_frames_do_not_take_the_server_down(clusters):
    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    # raw TCP garbage at the UCX port
    with socket.create_connection((node.host, node.port), timeout=5) as sock:
        sock.sendall(os.urandom(4096))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    ns = namespace_for_page_size(64 << 10, tenant="garbage")
    index = PageIndex(cluster.redis_url)
    index.ensure_namespace(ns)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "raw_client.py"),
            node.host,
            str(node.port),
            ns.digest_hex,
            ns.tenant,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    replies = json.loads(out.stdout.strip().splitlines()[-1])
    for case in (
        "garbage",
        "short",
        "bad_magic",
        "bad_version",
        "truncated",
        "oversized",
        "unknown_type",
        "bad_json",
        "server_frame",
        "bad_rows",
    ):
        assert replies[case] == "protocol", (case, replies[case])
    assert replies["valid_get_after_garbage"] == "GetPlan"
    assert replies["truncated_payload_plan"] == "PutPlan"
    assert replies["truncated_payload"].startswith(("closed", "stored=[] corrupt=[0]"))
    assert advertised_prefix(index, ns, [bytes.fromhex("2" * 32)], lease_ms=0) == 0
    assert cluster.nodes[0].process.poll() is None
    assert (
        run_worker(spec(cluster, ns, "put_pages", count=4 * ns.block_size))["reports"][0]["stored"]
        == 4
    )
    assert metrics(cluster, "node-0")['kvstore_errors_total{kind="protocol"}'] >= 10


@ON_BOTH_INDEXES
def test_sigterm_deregisters_and_exits_zero(clusters):
    # a 1.5 s TTL (heartbeats every 0.5 s) so the wait past it is short
    cluster = clusters(extra=["--node-ttl", "1.5", "--heartbeat-interval", "0.5"])
    ns = namespace_for_page_size(64 << 10, tenant="sigterm")
    tokens = list(range(4 * ns.block_size))
    run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    index = PageIndex(cluster.redis_url)
    time.sleep(2.0)  # past the node's TTL: only heartbeats keep the pages visible
    assert advertised_prefix(index, ns, block_hashes(ns, tokens), lease_ms=0) == 4
    node = cluster.nodes[0]
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(20) == 0
    assert index.live_nodes() == []
    assert advertised_prefix(index, ns, block_hashes(ns, tokens), lease_ms=0) == 0


def thread_wakeups(pid: int | str) -> int:
    """Voluntary context switches of every thread of a process so far: one per time a
    thread slept and woke."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                total += next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
                )
        except (OSError, StopIteration):
            pass  # a thread that ended meanwhile
    return total


def cpu_seconds(pid: int | str) -> float:
    """User and system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


IDLE_CLIENT = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[2])
from client import KVCacheClient
from kvstore import Namespace
from tests.test_server import cpu_seconds, thread_wakeups
small = Namespace(model="idle", dtype="float32", num_layers=1, num_kv_heads=1, head_size=64, block_size=16)
large = Namespace(model="idle-large", dtype="float16", num_layers=8, num_kv_heads=8, head_size=128, block_size=64)  # 2 MiB pages
for ns, n in ((small, 2), (large, 8)):  # large runs spin the loop's UCX progress while they move (kvstore.wire.loop_progress)
    client = KVCacheClient(sys.argv[1], ns, same_host=False)
    pages = torch.randn(n, *ns.page_shape, generator=torch.Generator().manual_seed(0)).to(getattr(torch, ns.dtype))
    tokens = list(range(n * ns.block_size))
    assert client.put_pages(tokens, pages).stored == n
    out = torch.empty_like(pages)
    assert client.get_pages(tokens, out) == len(tokens) and torch.equal(out, pages)
time.sleep(0.5)
before, cpu = thread_wakeups("self"), cpu_seconds("self")
time.sleep(2)
print(json.dumps({"wakeups": thread_wakeups("self") - before, "cpu": cpu_seconds("self") - cpu, "ucx": client.stats.direct_transfers}))
"""


def test_idle_node_and_ucx_client_sleep(clusters):
    """ucxx's progress thread woke every millisecond (2,000 wake-ups in 2 s); idle, a
    node and a client that moved pages over UCX, small ones and runs of 16 MiB (which
    spin UCX's progress while they move), now wake a few times a second (heartbeats,
    registry refreshes) and use under 2 % of a core."""
    cluster = clusters()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-c", IDLE_CLIENT, cluster.redis_url, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = json.loads(proc.stdout.strip().splitlines()[-1])
    assert client["ucx"] >= 1  # the pages went over UCX
    assert client["wakeups"] < 100 and client["cpu"] < 0.04, client
    node = cluster.nodes[0].process.pid
    time.sleep(1)  # the node closes the client's endpoints first
    before, cpu = thread_wakeups(node), cpu_seconds(node)
    time.sleep(3)
    assert thread_wakeups(node) - before < 150
    assert cpu_seconds(node) - cpu < 0.06


SPIN_BOUND = """
import asyncio, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvstore.wire import loop_progress
from kvstore.wire.transport import connect, ensure_ucx, listen
from tests.test_server import cpu_seconds

async def main():
    ucxx = ensure_ucx("loop")
    served = []
    listener = listen(ucxx, lambda ep: served.append(ep), 0)
    channel = await connect(ucxx, "127.0.0.1", listener.port, 10, "connect")
    progress = loop_progress._by_loop[asyncio.get_running_loop()]
    nbytes = 64 << 20
    pending = channel.post_recv(np.empty(nbytes, dtype=np.uint8), 7)  # no peer ever sends it
    await asyncio.sleep(0)
    spinning = progress.spinning
    await asyncio.sleep(loop_progress.spin_limit(nbytes) + 0.05)
    after_limit = progress.spinning
    cpu = cpu_seconds("self")
    await asyncio.sleep(1)
    idle_cpu = cpu_seconds("self") - cpu
    big = np.arange(nbytes, dtype=np.uint8)
    sent = channel.post_send(big, 8)
    await asyncio.sleep(0)
    moving = progress.spinning
    await channel.close()
    print(json.dumps({"spinning": spinning, "after_limit": after_limit, "idle_cpu": idle_cpu, "moving": moving,
                      "pending_done": pending.done(), "sent_done": sent.done(), "after_close": progress.spinning}))

asyncio.run(main())
"""


@pytest.mark.process
def test_loop_progress_spins_only_while_a_large_request_may_move():
    """A large receive nobody sends spins the loop's UCX progress for at most
    ``spin_limit`` (a peer that never sends costs a bounded time of a core), then the
    process idles; closing the channel ends what still spins."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-c", SPIN_BOUND, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["spinning"] == 1 and got["after_limit"] == 0, got
    assert got["idle_cpu"] < 0.05, got
    assert (
        got["moving"] == 1 and got["pending_done"] and got["sent_done"] and got["after_close"] == 0
    ), got


def test_metrics_and_probes(clusters):
    cluster = clusters(capacity="64MiB")
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    base = f"http://{node.extra['metrics']}"
    assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
    assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
    m = metrics(cluster, "node-0")
    assert m["kvstore_capacity_bytes"] == 64 << 20
    for name in (
        "kvstore_used_bytes",
        "kvstore_pages",
        "kvstore_put_pages_total",
        "kvstore_get_pages_total",
        "kvstore_received_bytes_total",
        "kvstore_sent_bytes_total",
        "kvstore_evicted_pages_total",
        "kvstore_refused_pages_total",
        "kvstore_requests_in_flight",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "kvstore_event_loop_lag_seconds",
    ):
        assert name in m, name
    assert m["kvstore_free_slabs"] >= 1
    assert m["kvstore_index_up"] == 1 and 0 <= m["kvstore_heartbeat_age_seconds"] < 5
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    assert "kvstore_request_seconds_bucket" in text
    assert re.search(
        r'kvstore_build_info\{python="[0-9.]+",ucxx="[^"]+",version="[^"]+"\} 1.0', text
    ), text[:2000]

    def ready() -> int:
        try:
            return urllib.request.urlopen(base + "/readyz", timeout=5).status
        except urllib.error.HTTPError as err:
            return err.code

    cluster.valkey.stop()  # heartbeats fail: the node stops reporting ready
    wait_for(lambda: ready() == 503, 20, "/readyz to turn 503")
    assert (
        urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
    )  # alive: only the index is gone
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    assert "kvstore_index_up 0.0" in text
    age = float(re.search(r"^kvstore_heartbeat_age_seconds ([0-9.e+-]+)$", text, re.M).group(1))
    assert age >= 1.0


def test_healthz_fails_while_the_event_loop_is_stuck():
    """The probe answers from its own thread, so it must ask the loop's watchdog: a
    blocked loop turns /healthz into 503, and it recovers once the loop runs again."""
    import asyncio
    import threading

    from prometheus_client import CollectorRegistry

    from server.health import LoopWatchdog, start_health_server

    watchdog = LoopWatchdog(interval=0.05, limit=0.5)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    loop.call_soon_threadsafe(watchdog.start)
    http = start_health_server("127.0.0.1", 0, CollectorRegistry(), lambda: True, watchdog.alive)

    def status() -> int:
        try:
            return urllib.request.urlopen(
                f"http://127.0.0.1:{http.server_port}/healthz", timeout=5
            ).status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        wait_for(lambda: status() == 200, 5, "/healthz to answer 200")
        loop.call_soon_threadsafe(time.sleep, 1.5)  # a blocking call on the loop
        wait_for(lambda: status() == 503, 5, "/healthz to turn 503 while the loop is blocked")
        wait_for(lambda: status() == 200, 5, "/healthz to recover")
        assert watchdog.lag >= 0
    finally:
        http.shutdown()
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.process
def test_bad_options_exit_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "server", "--capacity", "-1GiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "capacity" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "server", "--high-watermark", "0.5", "--low-watermark", "0.7"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "low_watermark" in out.stderr


def test_page_larger_than_a_slab_is_refused(clusters):
    cluster = clusters(capacity="8MiB", slab="1MiB")
    ns = namespace_for_page_size(2 << 20, tenant="too-big")
    report = run_worker(spec(cluster, ns, "put_pages", count=2 * ns.block_size))["reports"][0]
    assert report["stored"] == 0 and report["refused"] == 2
    assert metrics(cluster, "node-0")["kvstore_refused_pages_total"] == 2


def test_thread_progress_mode_serves_and_exits_on_sigterm(clusters):
    """ucxx's notifier thread (thread mode) is not a daemon: without the exit hook in
    kvstore.wire.transport the node hung at exit."""
    cluster = clusters(extra=["--ucx-progress-mode", "thread"])
    ns = namespace_for_page_size(64 << 10, tenant="thread-mode")
    tokens = list(range(8 * ns.block_size))
    assert (
        run_worker(
            spec(cluster, ns, "put_pages", tokens=tokens, options={"ucx_progress_mode": "thread"})
        )["reports"][0]["stored"]
        == 8
    )
    assert run_worker(spec(cluster, ns, "get_pages", tokens=tokens))["results"] == [
        {"blocks": 8, "matched": 8, "exact": True}
    ]
    node = cluster.nodes[0].process
    node.send_signal(signal.SIGTERM)
    assert node.wait(15) == 0


def test_bad_same_host_frames_and_a_hostile_writer_do_not_hurt_the_node(clusters):
    """The Unix-socket path (kvstore.wire.shm): garbage gets a protocol error; a client lent a
    writable slab cannot shrink it (the node would die of SIGBUS); bytes that do not
    match their checksum are not stored; the node serves on."""
    import mmap

    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    assert node.extra["host"] and os.path.exists(node.extra["shm"])
    ns = namespace_for_page_size(64 << 10, tenant="shm-garbage")
    PageIndex(cluster.redis_url).ensure_namespace(ns)

    def reply(sock: socket.socket) -> tuple[P._Frame, list[int]]:
        head, fds, _, _ = socket.recv_fds(sock, P.PREAMBLE.size, 8, socket.MSG_WAITALL)
        return P.decode(head + sock.recv(P.announced_length(head), socket.MSG_WAITALL)), fds

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(node.extra["shm"])
        sock.sendall(b"\x00\xffnot a frame at all" * 3)
        assert reply(sock)[0].code == "protocol"
    page = np.arange(65536, dtype=np.uint8)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(node.extra["shm"])
        sock.sendall(
            P.encode(
                P.PutRequest(
                    namespace=ns.digest_hex,
                    tenant=ns.tenant,
                    hashes=[b"3" * 16],
                    sizes=[page.nbytes],
                    join=[False],
                    anchors=[b"3" * 16],
                    positions=[0],
                )
            )
        )
        plan, fds = reply(sock)
        assert isinstance(plan, P.PutPlan) and len(fds) == 1 and plan.ints("wanted") == [0]
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], 0)  # sealed
        slab = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
        off = plan.ints("offsets")[0]
        slab[off : off + page.nbytes] = page.tobytes()
        sock.sendall(P.encode(P.PutChecksums(checksums=[page_checksum(page) ^ 1])))  # a lie
        result, _ = reply(sock)
        assert result.ints("stored") == [] and result.ints("corrupt") == [0]
        slab.close()
        os.close(fds[0])
    assert advertised_prefix(PageIndex(cluster.redis_url), ns, [b"3" * 16], lease_ms=0) == 0
    tokens = list(range(4 * ns.block_size))
    assert run_worker(spec(cluster, ns, "put_pages", tokens=tokens))["reports"][0]["stored"] == 4
    assert run_worker(spec(cluster, ns, "get_pages", tokens=tokens))["results"] == [
        {"blocks": 4, "matched": 4, "exact": True}
    ]
    assert metrics(cluster, "node-0")['kvstore_transfer_requests_total{op="get",path="shm"}'] >= 1
    assert cluster.nodes[0].process.poll() is None


def test_a_node_verifying_on_two_threads_refuses_exactly_the_page_that_lies(clusters):
    """A put large enough for the node to verify on two threads (kvstore.pages.checksum
    ``checksums``): of four 1 MiB pages written into their lent slots, the one whose
    checksum lies (third, so in the helper thread's half) is the only one refused as
    corrupt; the other three are stored and read back."""
    import mmap

    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    ns = namespace_for_page_size(1 << 20, tenant="verify-halves")
    PageIndex(cluster.redis_url).ensure_namespace(ns)
    pages = [np.full(1 << 20, k + 1, dtype=np.uint8) for k in range(4)]
    hashes = [bytes([k + 1]) * 16 for k in range(4)]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(node.extra["shm"])
        sock.sendall(
            P.encode(
                P.PutRequest(
                    namespace=ns.digest_hex,
                    tenant=ns.tenant,
                    hashes=hashes,
                    sizes=[p.nbytes for p in pages],
                    join=[False] * 4,
                    anchors=hashes,
                    positions=[0] * 4,
                )
            )
        )
        head, fds, _, _ = socket.recv_fds(sock, P.PREAMBLE.size, 8, socket.MSG_WAITALL)
        plan = P.decode(head + sock.recv(P.announced_length(head), socket.MSG_WAITALL))
        assert isinstance(plan, P.PutPlan) and plan.ints("wanted") == [0, 1, 2, 3]
        slabs = {
            region: mmap.mmap(fd, os.fstat(fd).st_size) for (region, _), fd in zip(plan.mapped, fds)
        }
        for page, region, off in zip(pages, plan.ints("regions"), plan.ints("offsets")):
            slabs[region][off : off + page.nbytes] = page.tobytes()
        sums = [page_checksum(p) for p in pages]
        sums[2] ^= 1  # a lie about the third page
        sock.sendall(P.encode(P.PutChecksums(checksums=np.array(sums, dtype=np.uint64))))
        head = sock.recv(P.PREAMBLE.size, socket.MSG_WAITALL)
        result = P.decode(head + sock.recv(P.announced_length(head), socket.MSG_WAITALL))
        assert result.ints("corrupt") == [2] and result.ints("stored") == [0, 1, 3]
        for m in slabs.values():
            m.close()
        for fd in fds:
            os.close(fd)
    assert metrics(cluster, "node-0")["kvstore_corrupt_pages_total"] == 1


def test_more_slabs_than_one_frame_can_carry_descriptors_for(clusters):
    """A same-host get that touches more slabs than SCM_RIGHTS carries at once (253)
    gets its descriptors over several frames marked ``more``, bit-exact."""
    cluster = clusters(capacity="20MiB", slab="64KiB")  # one 64 KiB page per slab
    ns = namespace_for_page_size(64 << 10, tenant="many-slabs")
    tokens = list(range(300 * ns.block_size))
    put = run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    assert put["reports"][0]["stored"] == 300 and put["stats"]["same_host_transfers"] == 1
    got = run_worker(spec(cluster, ns, "get_pages", tokens=tokens))
    assert (
        got["results"] == [{"blocks": 300, "matched": 300, "exact": True}]
        and got["stats"]["same_host_transfers"] == 1
    )


def test_a_client_that_cannot_reach_the_socket_falls_back_to_ucx(clusters):
    """A node whose Unix socket is not reachable from the client (another container's
    directory) is served over UCX, bit-exact, instead of looking dead."""
    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    os.unlink(node.extra["shm"])
    ns = namespace_for_page_size(64 << 10, tenant="fallback")
    tokens = list(range(4 * ns.block_size))
    result = run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    assert result["reports"][0]["stored"] == 4 and result["stats"]["same_host_transfers"] == 0
    assert result["stats"]["node_errors"] == 0  # not counted as a node failure
    got = run_worker(spec(cluster, ns, "get_pages", tokens=tokens))
    assert (
        got["results"] == [{"blocks": 4, "matched": 4, "exact": True}]
        and got["stats"]["same_host_transfers"] == 0
    )
    assert metrics(cluster, "node-0")['kvstore_transfer_requests_total{op="get",path="ucx"}'] >= 1


def test_pages_scattered_in_the_pool_move_as_many_runs_bit_exact(clusters):
    """Pages put one block at a time between another prompt's blocks get slots that never
    touch: a get of them is one payload message per page, more runs than the client
    posts receives ahead (client/nodes/connection.py RECEIVES_AHEAD), with pages the node
    lacks after them, and still lands bit-exact in another process."""
    from client.nodes.connection import RECEIVES_AHEAD

    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="scattered")
    blocks = 3 * RECEIVES_AHEAD
    a = list(range(blocks * ns.block_size))
    b = list(range(10**6, 10**6 + blocks * ns.block_size))
    interleaved = [t[: k * ns.block_size] for k in range(1, blocks + 1) for t in (a, b)]
    put = run_worker(
        spec(cluster, ns, "put_pages", token_lists=interleaved, options={"same_host": False})
    )
    assert sum(r["sent"] for r in put["reports"]) == 2 * blocks  # one new page per put
    before = metrics(cluster, "node-0")['kvstore_payload_messages_total{direction="out"}']
    asked = a + list(range(5 * 10**6, 5 * 10**6 + 4 * ns.block_size))  # 4 blocks no node holds
    got = run_worker(spec(cluster, ns, "get_pages", tokens=asked, options={"same_host": False}))
    assert got["results"] == [{"blocks": blocks + 4, "matched": blocks, "exact": True}]
    assert (
        metrics(cluster, "node-0")['kvstore_payload_messages_total{direction="out"}'] - before
        == blocks
    )
