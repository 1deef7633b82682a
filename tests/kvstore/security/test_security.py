"""Attacks with real processes (issue 12; the threat model is docs/security.md):
secrets in process arguments or output, a store started without a token, metrics
reachable from other hosts, passwords in URLs of error messages, stalled puts, and
tenants writing or reading each other's pages."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from client import KVCacheClient
from kvstore.index import PageIndex
from kvstore.index.routing import redact_url
from kvstore.tools.procutil import free_port
from kvstore.tools.valkey import EmbeddedValkey
from tests.support.helpers import KVSTORE_CLI as KVSTORE
from tests.support.helpers import cli_env, namespace_for_page_size, pages_for, wait_for
from tests.support.security import cmdline, make_ns

ENV = cli_env()  # no token: each test hands its processes the one it means


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            found.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_redacted_urls_hide_every_password_form():
    assert redact_url("redis://user:pw1@h:6379/0") == "redis://user:***@h:6379/0"
    assert "pw2" not in redact_url("redis://h:6379/0?password=pw2&db=1")
    assert "db=1" in redact_url("redis://h:6379/0?password=pw2&db=1")
    assert "pw3" not in redact_url("rediss+cluster://:pw3@a:1,b:2")
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


@pytest.mark.process
def test_a_node_takes_its_secrets_from_files_and_never_shows_them(tmp_path):
    token, password = "tok-" + "x" * 20, "pw-" + "y" * 20
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "password").write_text(password + "\n")
    ns = make_ns("secret-files")
    with EmbeddedValkey() as valkey:
        redis.Redis.from_url(valkey.url).config_set("requirepass", password)
        log = open(tmp_path / "node.log", "w")
        node = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "--redis-url",
                valkey.url,
                "--redis-password-file",
                str(tmp_path / "password"),
                "--auth-token-file",
                str(tmp_path / "token"),
                "--capacity",
                "64MiB",
                "--slab-size",
                "16MiB",
                "--host",
                "127.0.0.1",
                "--metrics-port",
                "0",
                "--node-id",
                "files-0",
                "--log-level",
                "DEBUG",
            ],
            env=ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            index = PageIndex(valkey.url, password=password)
            wait_for(
                lambda: [n.node_id for n in index.live_nodes()] == ["files-0"],
                30,
                "the node to register with the password from its file",
            )
            assert token not in cmdline(node.pid) and password not in cmdline(node.pid)
            tokens = list(range(2 * ns.block_size))
            with (
                KVCacheClient(
                    valkey.url, ns, redis_password=password, auth_token="wrong", timeout=3
                ) as intruder,
                pytest.raises(PermissionError, match="files-0: unauthorized"),
            ):
                intruder.put_pages(tokens, pages_for(ns, tokens))
            token_file = tmp_path / "client-token"
            token_file.write_text(token)
            with KVCacheClient(
                valkey.url,
                ns,
                redis_password_file=str(tmp_path / "password"),
                auth_token_file=str(token_file),
            ) as client:
                assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 2
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(30)
            log.close()
    output = (tmp_path / "node.log").read_text()
    assert "files-0" in output and token not in output and password not in output


@pytest.mark.process
def test_a_secret_given_twice_differently_is_refused(tmp_path):
    (tmp_path / "token").write_text("one")
    with pytest.raises(ValueError, match="auth_token"):
        KVCacheClient(
            "redis://127.0.0.1:1/0",
            make_ns("twice"),
            auth_token="two",
            auth_token_file=str(tmp_path / "token"),
        )
    out = subprocess.run(
        [sys.executable, "-m", "server", "--auth-token-file", str(tmp_path / "missing")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "cannot read auth_token_file" in out.stderr


@pytest.mark.process
def test_up_starts_with_a_random_token_it_never_prints():
    proc = subprocess.Popen(
        [*KVSTORE, "up", "--capacity", "64MiB", "--slab-size", "16MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while (
            not any(line.startswith("press Ctrl-C") for line in lines)
            and time.monotonic() < deadline
        ):
            lines.append(proc.stdout.readline())
        values = dict(
            line.strip().removeprefix("export ").split("=", 1)
            for line in lines
            if re.match(r"^export KVSTORE_[A-Z_]+=", line)
        )
        token_file = Path(values["KVSTORE_AUTH_TOKEN_FILE"])
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text()
        assert len(token) >= 32 and token not in "".join(lines)
        url = values["KVSTORE_REDIS_URL"]
        node = PageIndex(url).live_nodes()[0]
        assert token not in cmdline(int(node.extra["pid"]))
        ns = make_ns("up-token")
        tokens = list(range(2 * ns.block_size))
        with (
            KVCacheClient(url, ns, timeout=3) as anonymous,
            pytest.raises(PermissionError, match="KVSTORE_AUTH_TOKEN_FILE"),
        ):  # no token, no access, and told where one comes from
            anonymous.put_pages(tokens, pages_for(ns, tokens))
        with KVCacheClient(url, ns, auth_token_file=str(token_file)) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 2
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and token not in out + err
    # kept for the engines that read it: `up` on the same state directory serves it again
    assert token_file.read_text() == token and token_file.stat().st_mode & 0o777 == 0o600


@pytest.mark.process
def test_metrics_listen_on_loopback_unless_told_otherwise():
    with EmbeddedValkey() as valkey:
        port = free_port()
        node = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "--redis-url",
                valkey.url,
                "--capacity",
                "64MiB",
                "--slab-size",
                "16MiB",
                "--host",
                "127.0.0.1",
                "--metrics-port",
                str(port),
                "--node-id",
                "metrics-0",
                "--anonymous",
            ],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: listening_addresses(port), 30, "the metrics server to listen")
            assert listening_addresses(port) == {"127.0.0.1"}
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(30)


STALLED_PUT = r"""
import asyncio, sys, numpy as np
from kvstore.wire import protocol as P
from kvstore.wire.transport import Channel, ensure_ucx

async def main(host, port, ns_hex, tenant, pages, size):
    ucxx = ensure_ucx()
    ep = Channel(await ucxx.create_endpoint(host, port))
    hashes = [bytes([i + 1]) * 16 for i in range(pages)]
    await ep.send_frame(P.PutRequest(namespace=ns_hex, tenant=tenant, hashes=hashes, sizes=[size] * pages, join=[False] * pages,
                                     anchors=[hashes[0]] * pages, positions=list(range(pages))))
    plan = P.decode(await ep.recv_frame())
    print(type(plan).__name__, len(plan.ints("wanted")), flush=True)
    await asyncio.sleep(60)  # reserved slots, then nothing: no checksums, no payload

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])))
"""


@pytest.mark.process
def test_a_stalled_put_releases_its_slots_within_its_deadline():
    """An attacker reserves slots with a put and never sends the payload. The node gives
    them back after 2 s plus the put's size at --min-put-rate, not after the 30 s
    transfer timeout."""
    from kvstore.tools.launcher import LocalCluster
    from tests.support.helpers import metrics

    ns = namespace_for_page_size(2 << 20, tenant="stall")
    with LocalCluster(
        servers=1,
        capacity="64MiB",
        slab_size="16MiB",
        extra_args=["--transfer-timeout", "30", "--min-put-rate", "64MiB"],
    ) as cluster:
        with KVCacheClient(cluster.redis_url, ns):  # registers the namespace
            pass
        node = PageIndex(cluster.redis_url).live_nodes()[0]
        host, port = node.address.rsplit(":", 1)
        stalled = subprocess.Popen(
            [
                sys.executable,
                "-c",
                STALLED_PUT,
                host,
                port,
                ns.digest_hex,
                ns.tenant,
                "8",
                str(ns.page_nbytes),
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert stalled.stdout.readline().split() == ["PutPlan", "8"]
            reserved_at = time.monotonic()
            assert metrics(cluster, "node-0")["kvstore_used_bytes"] == 8 * ns.page_nbytes
            wait_for(
                lambda: metrics(cluster, "node-0")["kvstore_used_bytes"] == 0,
                15,
                "the stalled put's slots to be released",
            )
            held = time.monotonic() - reserved_at
            assert held < 2.0 + 16 / 64 + 3.0, (
                held
            )  # its deadline plus scheduling slack, far below 30 s
            assert metrics(cluster, "node-0")['kvstore_errors_total{kind="transfer"}'] == 1
            tokens = list(range(8 * ns.block_size))
            with KVCacheClient(cluster.redis_url, ns) as client:  # the pool is usable again
                assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
        finally:
            stalled.kill()
            stalled.wait(10)


# ---- tenant credentials -------------------------------------------------------------


OVERSIZED_CONTROL = r"""
import asyncio, sys, numpy as np
from kvstore.wire import protocol as P
from kvstore.wire.transport import Channel, ensure_ucx

async def main(host, port, rounds):
    ucxx = ensure_ucx()
    replies = []
    for _ in range(rounds):
        ep = Channel(await ucxx.create_endpoint(host, port))
        first = np.zeros(P.FIRST_MESSAGE_BYTES, dtype=np.uint8)
        first[: P.PREAMBLE.size] = np.frombuffer(P.PREAMBLE.pack(P.MAGIC, P.VERSION, P.FrameType.PUT_REQUEST, 256 << 20), dtype=np.uint8)
        await ep.send(first, P.CONTROL_TAG)
        sent = asyncio.ensure_future(ep.send(np.ones(256 << 20, dtype=np.uint8), P.CONTROL_TAG))  # the announced body
        frame = P.decode(await asyncio.wait_for(ep.recv_frame(), 10))
        replies.append(getattr(frame, "code", type(frame).__name__))
        await asyncio.sleep(0.2)
        sent.cancel()
        await ep.close()
    print(" ".join(sorted(set(replies))), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.process
def test_an_oversized_control_message_is_refused_before_the_node_allocates_it():
    """Finding 4: a 256 MiB control message drove node RSS from 133 to 620 MiB, because its
    size was checked after it had been received. The preamble's length is checked
    before the node posts a receive for the body: eight such messages leave RSS flat."""
    from kvstore.tools.launcher import LocalCluster

    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB") as c:
        node = PageIndex(c.redis_url).live_nodes()[0]
        host, port = node.address.rsplit(":", 1)
        pid = c.nodes[0].process.pid
        before = rss_bytes(pid)
        out = subprocess.run(
            [sys.executable, "-c", OVERSIZED_CONTROL, host, port, "8"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.stdout.split() == ["protocol"], out.stderr[-2000:]
        assert rss_bytes(pid) - before < 32 << 20
        assert c.nodes[0].process.poll() is None
