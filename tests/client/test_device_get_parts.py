"""A same-host get's plan in parts (``GetRequest.part_pages``, docs/protocol.md): the
field stays off the wire unless asked for (an older node refuses it); a real node sends
the plan part by part and keeps every part's pages pinned until GET_DONE; a device get
in parts lands bit-exact, and a page overwritten in one part is a miss, never wrong KV.
The copies of one part are queued while the node plans the next; what that gains on a
GPU is measured by ``bench/gpu_check.py`` (section 6)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import socket
import struct

import numpy as np
import pytest
import torch

import client.nodes.shm_connection as shm_connection
from client import KVCacheClient
from kvstore.pages._chainhash import split_hashes
from kvstore.wire import protocol as P
from kvstore.wire import shm
from tests.support.device_fixtures import (  # noqa: F401 (fixtures)
    BLOCK,
    COPIERS,
    cluster,
    copier,
    device_of,
    make_ns,
    same,
    scribbling,
)
from tests.support.helpers import pages_for, shm_path


def _header(frame: P.GetRequest) -> dict:
    body = P.encode(frame)[P.PREAMBLE.size :]
    (length,) = struct.unpack_from("<I", body)
    return json.loads(body[4 : 4 + length])


def test_part_pages_travels_only_when_asked_for():
    """A get without parts encodes as before the field existed (an older node, which
    rejects unknown fields, still reads it); one with parts carries and decodes it."""
    common = dict(namespace="0" * 32, tenant="t", hashes=[bytes(16)] * 3, join=[False] * 3)
    plain = P.GetRequest(**common)
    assert "part_pages" not in _header(plain)
    assert P.decode(P.encode(plain)).part_pages == 0
    parted = P.GetRequest(**common, part_pages=2)
    assert _header(parted)["part_pages"] == 2
    assert P.decode(P.encode(parted)).part_pages == 2
    with pytest.raises(ValueError, match="part_pages"):
        P.GetRequest(**common, part_pages=-1)


def test_a_node_sends_a_plan_in_parts_and_holds_the_pins_until_done(cluster, request):
    """Over the node's Unix socket: 7 pages asked for in parts of 3 (one of them never
    stored) come as plan frames of 3, 2 and 1 present pages, ``more`` set on all but the
    last; each part's slots hold the stored bytes, and still hold them after the whole
    plan arrived (nothing unpinned before GET_DONE); the connection then serves the next
    request."""
    ns = make_ns(request.node.name)
    tokens = list(range(7 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as client:
        assert client.put_pages(tokens, pages).stored == 7
        hashes = split_hashes(client.find(tokens).joined)
    path = shm_path(cluster)
    hashes[4] = bytes(16)  # never stored: left out of its part

    async def run() -> list[P.GetPlan]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        ch = shm.UnixChannel(sock)
        ask = P.GetRequest(
            namespace=ns.key.digest,
            tenant=ns.key.tenant,
            hashes=hashes,
            join=[False] * 7,
            part_pages=3,
        )
        await ch.send_frame(ask)
        plans, maps = [], {}
        while True:
            raw, fds = await ch.recv_frame()
            plan = P.decode(raw)
            assert isinstance(plan, P.GetPlan)
            for (region, _), fd in zip(plan.mapped, fds):
                maps[region] = np.frombuffer(
                    mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ), dtype=np.uint8
                )
                os.close(fd)
            plans.append(plan)
            if not plan.more:
                break
        await asyncio.sleep(0.2)  # long enough for an early unpin to free and reuse nothing
        for plan in plans:
            for i, region, off, size in zip(
                plan.ints("present"), plan.ints("regions"), plan.ints("offsets"), plan.ints("sizes")
            ):
                want = pages[i].contiguous().view(torch.uint8).numpy().reshape(-1)
                assert np.array_equal(maps[region][off : off + size], want)
        await ch.send_frame(P.GetDone())
        await ch.send_frame(ask)  # the connection serves the next get
        raw, fds = await ch.recv_frame()
        shm.close_fds(fds)
        assert isinstance(P.decode(raw), P.GetPlan)
        ch.close()
        return plans

    plans = asyncio.run(run())
    assert [p.ints("present") for p in plans] == [[0, 1, 2], [3, 5], [6]]
    assert [p.more for p in plans] == [True, True, False]


@pytest.mark.parametrize("bad", [None, 1], ids=["intact", "overwritten"])
def test_a_device_get_in_parts_is_exact_and_a_bad_page_is_a_miss(
    cluster, copier, bad, request, monkeypatch
):
    """A device get of 7 pages in parts of 2 lands every page bit-exact; with the
    second page of each part overwritten in the node's memory during the get, the
    prefix ends before the first of them, the pages before it are exact, and each
    overwritten page counts as a checksum failure. (Every page through the plan: the
    reader's slot reads, which would take them first, are turned off here.)"""
    ns = make_ns(request.node.name)
    monkeypatch.setattr(shm_connection, "PART_BYTES", 2 * ns.page_nbytes)
    monkeypatch.setattr(shm_connection, "slot_part", lambda *args: None)
    tokens = list(range(7 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
        assert writer.put_pages(tokens, pages).stored == 7
    device = COPIERS[copier] if bad is None else scribbling(COPIERS[copier], bad)
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=device) as reader:
        rows = torch.zeros((7, *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
        got = reader.get_found_device(reader.find(tokens), rows)
        if bad is None:
            assert got == len(tokens) and same(rows, pages)
            assert reader.stats.checksum_failures == 0
        else:
            assert got == BLOCK and same(rows[:1], pages[:1])
            assert reader.stats.checksum_failures == 3  # parts (0,1), (2,3), (4,5); (6) alone


def test_a_connection_dropped_without_close_undoes_its_registrations(cluster, request):
    """A same-host connection that is dropped without ``close`` (a client nobody closed)
    undoes its slabs' registrations before their mappings go: a stale registration would
    have the driver copy a later mapping at the same address from the old pages."""
    import gc

    from client.memory.device_pages import HostCopier

    undone: list[int] = []

    class Registering(HostCopier):
        def register(self, mapping, writable):
            return mapping.ctypes.data

        def unregister(self, token):
            undone.append(token)

    ns = make_ns(request.node.name)
    tokens = list(range(3 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=Registering) as client:
        assert client.put_pages(tokens, pages).stored == 3
        rows = torch.zeros((3, *ns.page_shape), dtype=pages.dtype)
        assert client.get_found_device(client.find(tokens), rows) == len(tokens)
        conns = client._async.nodes._conns
        (conn,) = [c for c in conns.values() if c.path == "shm"]
        registered = [t for t in conn._slabs.registered.values() if t is not None]
        assert registered and not undone
        conns.clear()  # dropped by its directory, never closed
        del conn
        gc.collect()
        assert sorted(undone) == sorted(registered)


@pytest.mark.parametrize(
    "plan",
    [
        dict(present=[1, 0], sizes=[8192] * 2, checksums=[0, 0], regions=[0, 0], offsets=[0, 8192]),
        dict(present=[0, 0], sizes=[8192] * 2, checksums=[0, 0], regions=[0, 0], offsets=[0, 0]),
        dict(present=[0], sizes=[8192], checksums=[0], regions=[0], offsets=[2**64 - 4096]),
        dict(present=[5], sizes=[8192], checksums=[0], regions=[0], offsets=[0]),
    ],
    ids=["out-of-order", "twice", "offset-past-any-slab", "not-asked"],
)
def test_a_device_get_refuses_a_plan_no_node_would_send(tmp_path, plan):
    """A plan whose pages are out of request order, named twice, at an offset past any
    slab or at a position never asked for fails the get on that node before anything is
    copied (the node is then suspected by the caller): its pages are misses."""
    from client.memory.device_pages import HostCopier
    from client.memory.device_rows import device_spans
    from client.nodes.shm_connection import ShmConnection
    from client.stats import ClientStats
    from kvstore.errors import TransportError
    from kvstore.index import NodeInfo
    from kvstore.pages.keys import NamespaceKey

    path = str(tmp_path / "node.sock")
    node = NodeInfo("n", "", 0, "i", extra={"shm": path, "get_parts": "1"})

    async def run() -> str:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        server.setblocking(False)

        async def answer() -> None:
            sock, _ = await asyncio.get_running_loop().sock_accept(server)
            sock.setblocking(False)
            ch = shm.UnixChannel(sock)
            await ch.recv_frame()
            await ch.send_frame(P.GetPlan(runs=[], **plan))
            await asyncio.sleep(1)
            ch.close()

        node_side = asyncio.ensure_future(answer())
        conn = ShmConnection(node, "", HostCopier(ClientStats()))
        rows = torch.zeros(2 * 8192, dtype=torch.uint8)
        try:
            await conn.get(
                NamespaceKey("t", "0" * 32), [bytes(16)] * 2, device_spans(rows, 2, 8192), [0, 0], 5
            )
        except TransportError as exc:
            return str(exc)
        finally:
            node_side.cancel()
            server.close()
        return "no error"

    said = asyncio.run(run())
    assert "planned a page twice" in said or "inconsistent get plan" in said
