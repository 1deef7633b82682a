"""A storage node as a process: idle CPU of the node and of a UCX client, progress
modes, metrics and probes, a stuck event loop, bad options."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvstore.index import PageIndex
from tests.support.helpers import (
    ROOT,
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
)
from tests.support.proc_stats import cpu_seconds, thread_wakeups

IDLE_CLIENT = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[2])
from client import KVCacheClient
from kvstore import Namespace
from tests.support.proc_stats import cpu_seconds, thread_wakeups
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
from tests.support.proc_stats import cpu_seconds

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
