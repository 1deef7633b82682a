"""Hostile or broken peers of a node: a made-up tenant, clients that stall in the UCX
handshake, and a flood of one kind of log line hiding no other."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from client import KVCacheClient
from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from kvstore.wire import protocol as P
from tests.support.helpers import (
    cli_env,
    make_credentials,
    metrics,
    namespace_for_page_size,
    pages_for,
    run_worker,
    shm_path,
    spec,
    unix_reply,
    wait_for,
)

ENV = cli_env()  # no token: each test hands its processes the one it means


@pytest.mark.process
def test_a_made_up_tenant_is_refused_whether_or_not_the_namespace_is_cached(tmp_path):
    """A PUT naming a namespace digest with a tenant that is not the namespace's got
    ``unknown_namespace`` while the node had not cached the namespace, and a PutPlan
    once it had. Now the answer does not depend on the cache."""
    creds, token = make_credentials(tmp_path, ("alice", "readwrite", ["team-a", "made-up"]))
    ns = namespace_for_page_size(64 << 10, tenant="team-a")
    tokens = list(range(2 * ns.block_size))
    alice = token["alice"].read_text().strip()
    with LocalCluster(
        servers=1, capacity="64MiB", slab_size="16MiB", env={"KVSTORE_CREDENTIALS_FILE": str(creds)}
    ) as c:
        PageIndex(c.redis_url).ensure_namespace(ns)

        def put_as(tenant: str) -> str:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(10)
                sock.connect(shm_path(c))
                sock.sendall(
                    P.encode(
                        P.PutRequest(
                            namespace=ns.digest_hex,
                            tenant=tenant,
                            token=alice,
                            hashes=[b"7" * 16],
                            sizes=[64 << 10],
                            join=[False],
                            anchors=[b"7" * 16],
                            positions=[0],
                        )
                    )
                )
                reply = unix_reply(sock)
                return getattr(reply, "code", type(reply).__name__)

        assert put_as("made-up") == "unknown_namespace"  # not cached yet
        with KVCacheClient(c.redis_url, ns, auth_token_file=str(token["alice"])) as client:
            assert (
                client.put_pages(tokens, pages_for(ns, tokens)).stored == 2
            )  # the node caches the namespace
        assert put_as("made-up") == "unknown_namespace"
        assert put_as("team-a") == "PutPlan"  # the genuine tenant still gets a plan


# ---- 7. clients that abort in ucxx's handshake ------------------------------------


STALLED_HANDSHAKES = r"""
import asyncio, sys, time
from kvstore.wire.transport import ensure_ucx

async def main(host, port, count, hold):
    ensure_ucx()
    from ucxx._lib import libucxx
    import ucxx
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    # endpoints that connect and never exchange ucxx's peer info, as a client that
    # stalls or dies while connecting
    eps = [libucxx.UCXEndpoint.create(ctx.worker, host, port, True) for _ in range(count)]
    await asyncio.sleep(hold)
    print("done", flush=True)  # the endpoints go with the process

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
"""


def test_clients_that_stall_in_the_ucx_handshake_leave_a_count_not_tracebacks(clusters):
    """Reproduced: 10,000 connect/abort cycles left 37 tracebacks from ucxx's listener
    handshake in the node's log. Three clients that connect and never finish the
    handshake now leave one rate-limited line and a count of three."""
    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    host, port = node.address.rsplit(":", 1)
    out = subprocess.run(
        [sys.executable, "-c", STALLED_HANDSHAKES, host, port, "3", "7"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    wait_for(
        lambda: metrics(cluster, "node-0").get("kvstore_handshake_failures_total", 0) >= 3,
        15,
        "the failed handshakes to be counted",
    )
    log = cluster.nodes[0].log()
    assert "Traceback" not in log and "Unexpected error in listener handler coroutine" not in log
    assert log.count("failed during ucxx's handshake") == 1
    ns = namespace_for_page_size(64 << 10, tenant="after-handshakes")
    tokens = list(range(4 * ns.block_size))
    run_worker(spec(cluster, ns, "put_pages", tokens=tokens, options={"same_host": False}))
    assert run_worker(spec(cluster, ns, "get_pages", tokens=tokens, options={"same_host": False}))[
        "results"
    ] == [{"blocks": 4, "matched": 4, "exact": True}]


def test_a_flood_of_one_kind_of_peer_line_hides_no_other_kind(caplog):
    """Pure logic: the node's rate-limited log keeps one budget per kind of line, so
    a peer flooding one kind (say, refused descriptors) cannot silence another (a
    failed accept) for the interval, and the next line of a kind says how many of it
    were left out."""
    import logging

    from server.limits import RateLimitedLog

    peers = RateLimitedLog(logging.getLogger("tests.peers"), interval=0.3)
    with caplog.at_level(logging.WARNING, logger="tests.peers"):
        assert [peers("refused %s", i) for i in range(50)] == [True] + [False] * 49
        assert peers("accept failed: %s", "EMFILE")
        time.sleep(0.35)
        assert peers("refused %s", 50)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 0",
        "accept failed: EMFILE",
        caplog.records[2].getMessage(),
    ]
    assert caplog.records[2].getMessage().startswith("refused 50 (49 more like it in the last")
