"""The kvstore command line: up (clean shutdown), demo, stats, server --help."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvstore.index import PageIndex
from kvstore.procutil import pid_alive

KVSTORE = [sys.executable, "-m", "kvstore.cli"]
ENV = {**os.environ, "UCX_NET_DEVICES": "lo"}


@pytest.mark.parametrize("shards", [1, 3])
def test_up_serves_until_interrupted_and_leaves_no_processes(shards):
    proc = subprocess.Popen([*KVSTORE, "up", "--servers", "2", "--capacity", "64MiB", "--slab-size", "16MiB", "--index-shards", str(shards)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("KVSTORE_REDIS_URL="):
            url = line.strip().split("=", 1)[1]
    assert url, proc.stderr.read()
    assert url.startswith("redis+cluster://" if shards > 1 else "redis://")
    nodes = PageIndex(url).live_nodes()
    assert sorted(n.node_id for n in nodes) == ["node-0", "node-1"]
    pids = [int(n.extra["pid"]) for n in nodes]
    ports = [hostport.rsplit(":", 1)[1] for hostport in url.split("://", 1)[1].split("/")[0].split(",")]
    valkey_pids = [int(subprocess.run(["pgrep", "-f", f"valkey-server 127.0.0.1:{port}"], capture_output=True, text=True).stdout.split()[0]) for port in ports]
    assert len(valkey_pids) == shards
    stats = subprocess.run([*KVSTORE, "stats", "--redis-url", url], capture_output=True, text=True, timeout=60, env=ENV)
    assert stats.returncode == 0 and "2 live node(s)" in stats.stdout
    assert (f"a cluster of {shards} shard(s)" in stats.stdout) == (shards > 1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert "stopped" in proc.stdout.read()
    time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids + valkey_pids)


def test_up_refuses_a_bad_shard_count():
    out = subprocess.run([*KVSTORE, "up", "--index-shards", "0"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 2 and "--index-shards must be at least 1" in out.stderr


def test_stats_lists_nodes_and_namespaces():
    from kvstore.launcher import LocalCluster

    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        out = subprocess.run([*KVSTORE, "stats", "--redis-url", cluster.redis_url], capture_output=True, text=True, timeout=60, env=ENV)
        assert out.returncode == 0
        assert "1 live node(s)" in out.stdout and "node-0" in out.stdout


def test_server_help_lists_options_and_env():
    out = subprocess.run([*KVSTORE, "server", "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0
    for option in ("--redis-url", "--capacity", "--port", "--node-id", "--metrics-port", "--high-watermark", "--ucx-net-devices"):
        assert option in out.stdout


def test_demo_verifies_every_byte():
    out = subprocess.run([*KVSTORE, "demo", "--servers", "1", "--tokens", "300", "--shared", "100"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bytes verified: OK" in out.stdout
    assert "300/300" in out.stdout and "96/300" in out.stdout  # shared prefix: 6 full blocks of 16
    assert "sent 13 pages, 6 already stored" in out.stdout
