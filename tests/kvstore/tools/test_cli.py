"""The kvstore command line: up (clean shutdown), demo, stats, server --help."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvstore.index import PageIndex
from kvstore.tools.procutil import free_port, pid_alive

pytestmark = pytest.mark.process  # every test here starts a node or a Python process

KVSTORE = [sys.executable, "-m", "kvstore.tools.cli"]
ENV = {
    **os.environ,
    "UCX_NET_DEVICES": "lo",
    "KVSTORE_ANONYMOUS": "true",
}  # nodes started here have no credential


@pytest.mark.parametrize("shards", [1, 3])
def test_up_serves_until_interrupted_and_leaves_no_processes(shards, tmp_path):
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [
            *KVSTORE,
            "up",
            "--servers",
            "2",
            "--capacity",
            "64MiB",
            "--slab-size",
            "16MiB",
            "--index-shards",
            str(shards),
            "--log-dir",
            str(log_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    url = None
    shown: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        shown.append(line)
        if line.startswith("export KVSTORE_REDIS_URL="):
            url = line.strip().split("=", 1)[1]
        if line.startswith("press Ctrl-C"):
            break
    assert url, proc.stderr.read()
    # progress while it starts, then each node's ports and log file
    assert any("registered after" in line for line in shown) and any(
        "faults in 64MiB of page memory" in line for line in shown
    ), shown
    for node in ("node-0", "node-1"):
        line = next(x for x in shown if x.strip().startswith(f"{node}: data 127.0.0.1:"))
        assert "metrics http://127.0.0.1:" in line and f"log {log_dir / node}.log" in line
    assert url.startswith("redis+cluster://" if shards > 1 else "redis://")
    nodes = PageIndex(url).live_nodes()
    assert sorted(n.node_id for n in nodes) == ["node-0", "node-1"]
    pids = [int(n.extra["pid"]) for n in nodes]
    ports = [
        hostport.rsplit(":", 1)[1] for hostport in url.split("://", 1)[1].split("/")[0].split(",")
    ]
    valkey_pids = [
        int(
            subprocess.run(
                ["pgrep", "-f", f"valkey-server 127.0.0.1:{port}"], capture_output=True, text=True
            ).stdout.split()[0]
        )
        for port in ports
    ]
    assert len(valkey_pids) == shards
    stats = subprocess.run(
        [*KVSTORE, "stats", "--redis-url", url], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert stats.returncode == 0 and "2 live node(s)" in stats.stdout
    assert (f"a cluster of {shards} shard(s)" in stats.stdout) == (shards > 1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert f"stopped; node logs kept in {log_dir}" in proc.stdout.read()
    time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids + valkey_pids)
    assert "kvstore-server node=node-0" in (log_dir / "node-0.log").read_text()  # kept after exit


UNREACHABLE = f"redis://127.0.0.1:{free_port()}/0"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["stats", "--redis-url", "notaurl"],
            2,
            "kvstore stats: Redis URL must start with redis://",
        ),
        (["stats", "--redis-url", UNREACHABLE], 3, "kvstore stats: Redis at redis://127.0.0.1"),
        (["up", "--servers", "0"], 2, "kvstore up: --servers must be at least 1, got 0"),
        (["up", "--index-shards", "0"], 2, "kvstore up: --index-shards must be at least 1"),
        (["up", "--redis-url", "notaurl"], 2, "kvstore up: Redis URL must start with"),
        (["up", "--redis-url", UNREACHABLE], 3, "is unreachable"),
        (
            ["server", "--redis-url", "notaurl"],
            2,
            "kvstore server: --redis-url: Redis URL must start with",
        ),
        (
            ["server", "--log-level", "foo"],
            2,
            "kvstore server: --log-level: Input should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'",
        ),
        (
            ["server", "--capacity", "1MiB", "--slab-size", "64MiB"],
            2,
            "kvstore server: capacity 1048576 bytes must be at least one slab",
        ),
    ],
    ids=[
        "stats-bad-url",
        "stats-unreachable",
        "up-no-servers",
        "up-no-shards",
        "up-bad-url",
        "up-unreachable",
        "server-bad-url",
        "server-log-level",
        "server-capacity",
    ],
)
def test_user_errors_are_one_line_and_a_documented_exit_code(args, code, message):
    start = time.monotonic()
    out = subprocess.run([*KVSTORE, *args], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == code, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and message in out.stderr
    assert time.monotonic() - start < 20  # no waiting for nodes that cannot start


@pytest.mark.parametrize("which", ["metrics", "ucx"])
def test_a_port_in_use_is_one_line_and_exit_1(which):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        flags = (
            ["--metrics-port", port, "--metrics-host", "0.0.0.0"]
            if which == "metrics"
            else ["--port", port, "--metrics-port", "0"]
        )
        out = subprocess.run(
            [
                *KVSTORE,
                "server",
                "--redis-url",
                UNREACHABLE,
                "--capacity",
                "64MiB",
                "--slab-size",
                "16MiB",
                "--host",
                "127.0.0.1",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert (
        out.stderr.strip().splitlines()[-1]
        == f"kvstore server: the {'metrics' if which == 'metrics' else 'UCX'} port {port} is in use; pick another with --{'metrics-port' if which == 'metrics' else 'port'} (0: any free port)"
    )


def test_stats_lists_nodes_namespaces_use_and_reads():
    from client import KVCacheClient
    from kvstore.tools.launcher import LocalCluster
    from tests.support.helpers import namespace_for_page_size, pages_for, wait_for

    ns = namespace_for_page_size(64 << 10, tenant="stats")
    tokens = list(range(4 * ns.block_size))
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as cluster:
        with KVCacheClient(cluster.redis_url, ns) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 4
            out = torch.empty(6, *ns.page_shape, dtype=torch.float16)
            assert (
                client.get_pages(tokens + list(range(2 * ns.block_size)), out) == 4 * ns.block_size
            )

        def stats_json() -> dict:
            out = subprocess.run(
                [*KVSTORE, "stats", "--json", "--redis-url", cluster.redis_url],
                capture_output=True,
                text=True,
                timeout=60,
                env=ENV,
            )
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        wait_for(
            lambda: stats_json()["nodes"][0].get("hits") == 4,
            10,
            "the heartbeat to carry the reads",
        )  # heartbeats carry them
        doc = stats_json()
        node = doc["nodes"][0]
        assert (
            node["node_id"] == "node-0" and node["used"] >= 4 * (64 << 10) and node["misses"] == 0
        )
        assert (
            doc["namespaces"][0]["pages"] == 4
            and doc["namespaces"][0]["namespace"]["tenant"] == "stats"
        )
        text = subprocess.run(
            [*KVSTORE, "stats", "--redis-url", cluster.redis_url],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
        assert text.returncode == 0
        assert (
            "1 live node(s)" in text.stdout
            and "node-0" in text.stdout
            and "4 pages read" in text.stdout
        )
        # what tells namespaces apart, on the namespace's line
        line = next(x for x in text.stdout.splitlines() if "       4 pages" in x)
        assert (
            f"{ns.model} {ns.dtype} {ns.layout} layers {ns.num_layers} heads {ns.num_kv_heads}x{ns.head_size} block {ns.block_size}"
            in line
        )
        assert "head groups 1 pp 0 tenant stats" in line


def test_version():
    out = subprocess.run(
        [*KVSTORE, "--version"], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert out.returncode == 0 and re.fullmatch(r"kvstore \d+\.\d+\.\d+\n", out.stdout)


def test_server_help_lists_options_and_env():
    out = subprocess.run(
        [*KVSTORE, "server", "--help"], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert out.returncode == 0
    for option in (
        "--redis-url",
        "--capacity",
        "--port",
        "--node-id",
        "--metrics-port",
        "--high-watermark",
        "--ucx-net-devices",
    ):
        assert option in out.stdout
    # what each flag takes, in words, not Python types
    assert "--capacity SIZE" in out.stdout and "(default: 1GiB)" in out.stdout
    assert "--auth-token TOKEN" in out.stdout and "--metrics-port PORT" in out.stdout
    for python_type in ("SecretStr", "{int,null}", "{str,null}", " int ", "default factory"):
        assert python_type not in out.stdout, python_type


def test_up_says_why_its_nodes_exited():
    """A node that cannot start is named with its own error line (from its log), and
    the exit code is 1."""
    out = subprocess.run(
        [*KVSTORE, "up", "--capacity", "8MiB", "--slab-size", "16MiB"],
        capture_output=True,
        text=True,
        timeout=90,
        env=ENV,
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert (
        "node-0: kvstore server: capacity 8388608 bytes must be at least one slab" in out.stderr
    ), out.stderr


def test_demo_verifies_every_byte_and_with_a_disk_tier_serves_a_prefix_from_disk():
    """The demo's steps (README's first command runs them without ``--disk``: the same
    steps on nodes without a disk tier), then with ``--disk`` prompt A served from disk
    after other prompts pushed it out of memory and after every node restarted. One run
    covers both: a demo without ``--disk`` would start five more Python processes (about
    30 s of the suite on two loaded cores) for the same first five steps."""
    out = subprocess.run(
        [*KVSTORE, "demo", "--disk", "--servers", "1", "--tokens", "300", "--shared", "100"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bytes verified: OK" in out.stdout
    assert "300/300" in out.stdout and "96/300" in out.stdout  # shared prefix: 6 full blocks of 16
    assert "sent 13 pages, 6 already stored" in out.stdout
    assert (
        "decode A: select after A left memory" in out.stdout
        and "decode A: select after the restart" in out.stdout
    )
    assert (
        "prompt A from disk: 19 of its 19 pages after it left memory, 19 after the restart"
        in out.stdout
    )
