"""Same-host device gets read pages straight from the slots the index places them in
(client/nodes/slot_reads.py, docs/protocol.md SLOT_READS): no plan round trip for pages
in slabs the reader mapped; a page torn or moved meanwhile fails its check and is read
again through a plan (never wrong KV); the node is told, counts the read, and never
answers the notice, whatever it makes of it. What the round trip saved on a GPU is
measured by ``bench/gpu_check.py`` (sections 1 and 6)."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch

import client.nodes.shm_connection as shm_connection
from client import KVCacheClient
from client.memory.device_pages import DeviceCopier
from client.memory.layer_feed import LayerFeed
from client.stats import ClientStats
from kvstore.errors import TransportError
from kvstore.index import NodeInfo, PageIndex
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
    scribble,
)
from tests.support.helpers import make_credentials, metrics, pages_for, wait_for

GETS = 'kvstore_transfer_requests_total{op="get",path="shm"}'
NOTICES = 'kvstore_transfer_requests_total{op="slot_reads",path="shm"}'
SLOT_READS = "kvstore_slot_read_pages_total"


def _node(**extra: str) -> NodeInfo:
    return NodeInfo("node-x", "127.0.0.1:1", 1 << 30, "0" * 24 + "abcd1234", extra=extra)


def test_slot_part_keeps_pages_in_mapped_slabs_and_within_them():
    """Of a get's index slots, only those in a slab the connection mapped, whole within
    it, are read straight (with the index's checksums); none without the node's slab
    size (an older node), without mapped slabs, or when none lies in one."""
    maps = {0: np.zeros(1024, dtype=np.uint8), 2: np.zeros(512, dtype=np.uint8)}
    slots = np.array([0, 256, 1024 + 256, 2048, 2048 + 384], dtype=np.uint64)
    expected = np.array([10, 11, 12, 13, 14], dtype=np.uint64)
    part = shm_connection.slot_part(_node(slab_bytes="1024"), slots, expected, maps, 256)
    assert part is not None
    assert part.present.tolist() == [0, 1, 3]  # slab 1 unmapped; the last runs past its slab
    assert part.regions.tolist() == [0, 0, 2] and part.offsets.tolist() == [0, 256, 0]
    assert part.checksums.tolist() == [10, 11, 13]
    assert shm_connection.slot_part(_node(), slots, expected, maps, 256) is None
    assert shm_connection.slot_part(_node(slab_bytes="x"), slots, expected, maps, 256) is None
    assert shm_connection.slot_part(_node(slab_bytes="1024"), slots, expected, {}, 256) is None
    only_one = {1: np.zeros(1024, dtype=np.uint8)}
    assert (
        shm_connection.slot_part(_node(slab_bytes="4096"), slots, expected, only_one, 256) is None
    )


def _torn(make, page: int):
    """A copier of kind ``make`` whose second landing (the first is the get through a
    plan that registers the slabs) has its ``page``-th page overwritten in the node's
    memory just before its copy and put back once that landing's digests are in: a
    slot reused and given back while a reader copied it."""

    def build(stats: ClientStats) -> DeviceCopier:
        inner = make(stats)
        made: list[object] = []

        class Torn(type(inner)):  # type: ignore[misc]
            def landing(self, rows):
                landing = super().landing(rows)
                made.append(landing)
                if len(made) != 2:
                    return landing
                add, digests = landing.add, landing.digests
                torn = []

                def add_torn(positions, copies):
                    if len(copies) > page:
                        torn.append(copies.source(page))
                        scribble(torn[0])
                    add(positions, copies)

                async def digests_then_mend():
                    try:
                        return await digests()
                    finally:
                        for span in torn:
                            scribble(span)  # the same flips again: the bytes as stored

                landing.add, landing.digests = add_torn, digests_then_mend
                return landing

        inner.__class__ = Torn
        return inner

    return build


def _stored(cluster, name: str, count: int):
    ns = make_ns(name)
    tokens = list(range(count * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
        assert writer.put_pages(tokens, pages).stored == count
    return ns, tokens, pages


def _get(reader, found, ns, pages, copier) -> torch.Tensor:
    rows = torch.zeros((len(pages), *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
    assert reader.get_found_device(found, rows) == len(pages) * BLOCK
    assert same(rows, pages)
    return rows


def test_a_device_get_reads_index_slots_without_a_plan(cluster, copier, request):
    """A reader whose slabs were mapped at start (not yet registered) lands its first
    device get through the node's plan, which registers them; its next get lands
    bit-exact from the index's slots alone: no GET reaches the node for it, one
    SLOT_READS notice does, and the node counts every page as read."""
    ns, tokens, pages = _stored(cluster, request.node.name, 7)
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=COPIERS[copier]) as reader:
        found = reader.find(tokens)
        start = metrics(cluster, "node-0")
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 0
        before = metrics(cluster, "node-0")
        assert before[GETS] == start[GETS] + 1
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 7 and reader.stats.slot_read_misses == 0
        assert reader.stats.checksum_failures == 0
        wait_for(
            lambda: metrics(cluster, "node-0")[SLOT_READS] == before[SLOT_READS] + 7,
            5,
            "the notice",
        )
        after = metrics(cluster, "node-0")
    assert after[GETS] == before[GETS] and after[NOTICES] == before[NOTICES] + 1


def test_a_page_torn_during_its_slot_read_is_read_again_through_a_plan(cluster, copier, request):
    """A page whose slot changes under a slot read fails its check, is asked for again
    through a plan (which pins it), and lands exact: a miss of the fast path, not a
    checksum failure and not a miss of the get."""
    ns, tokens, pages = _stored(cluster, request.node.name, 7)
    device = _torn(COPIERS[copier], 2)
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=device) as reader:
        found = reader.find(tokens)
        _get(reader, found, ns, pages, copier)  # through a plan: registers the slabs
        before = metrics(cluster, "node-0")
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 7 and reader.stats.slot_read_misses == 1
        assert reader.stats.checksum_failures == 0
    assert metrics(cluster, "node-0")[GETS] == before[GETS] + 1  # the torn page's plan


def test_pages_in_slabs_no_plan_registered_come_through_a_plan(cluster, copier, request):
    """Slot reads take a get only when every page lies in a slab a plan registered: a
    reader that started before its tenant had any slab reads a get through the plan
    (which lends and registers the slabs), then the same pages from their slots; a
    get with one page in a slab no plan registered goes wholly through a plan; and a
    get landing layer by layer always does."""
    ns = make_ns(request.node.name)
    tokens = list(range(4 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=COPIERS[copier]) as reader:
        with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
            assert writer.put_pages(tokens, pages).stored == 4
        found = reader.find(tokens)
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 0
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 4 and reader.stats.slot_read_misses == 0
        (conn,) = [c for c in reader._async.nodes._conns.values() if c.path == "shm"]
        slab = next(iter(conn._slabs.registered))
        conn._slabs._unregister(slab)  # as if that slab's mapping had just been replaced
        _get(reader, found, ns, pages, copier)
        assert reader.stats.slot_reads == 4
        if reader.lands_layers(device_of(copier)):
            rows = torch.zeros((4, *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
            feed = LayerFeed(ns.num_layers, 4)
            assert reader.get_found_device(found, rows, feed=feed) == len(tokens)
            assert same(rows, pages) and reader.stats.slot_reads == 4


async def _notice_then_get(path: str, notice: P.SlotReads, ask: P.GetRequest) -> object:
    """Over one Unix-socket connection: the notice, then a get; what answers the get
    (None when the node closed the connection instead)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, path)
    ch = shm.UnixChannel(sock)
    try:
        await ch.send_frame(notice)
        try:
            await ch.send_frame(ask)
            raw, fds = await asyncio.wait_for(ch.recv_frame(), 5)
        except (shm.PeerClosedError, TransportError):  # closed, or reset under the send
            return None
        shm.close_fds(fds)
        frame = P.decode(raw)
        if isinstance(frame, P.GetPlan):
            await ch.send_frame(P.GetDone())
        return frame
    finally:
        ch.close()


@pytest.mark.process
def test_a_notice_is_never_answered_and_one_refused_changes_nothing(tmp_path):
    """A SLOT_READS notice gets no reply: one the credential covers is counted and the
    next get on the connection reads its own plan; one for a tenant the credential
    does not cover is dropped (nothing counted, and the next get still reads its own
    answer, not an ERROR meant for the notice); one with a token that matches no
    credential closes the connection."""
    from kvstore.tools.launcher import LocalCluster

    creds, token = make_credentials(
        tmp_path, ("alice", "readwrite", ["team-a"]), ("bob", "readwrite", ["team-b"])
    )
    alice_ns, bob_ns = make_ns("notice", tenant="team-a"), make_ns("notice", tenant="team-b")
    tokens = list(range(2 * BLOCK))
    env = {"KVSTORE_CREDENTIALS_FILE": str(creds)}
    with LocalCluster(servers=1, capacity="64MiB", slab_size="16MiB", env=env) as c:
        hashes = {}
        for name, ns in (("alice", alice_ns), ("bob", bob_ns)):
            with KVCacheClient(c.redis_url, ns, auth_token_file=str(token[name])) as client:
                assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 2
                hashes[name] = split_hashes(client.find(tokens).joined)
        alice = token["alice"].read_text().strip()
        index = PageIndex(c.redis_url)
        try:
            path = index.live_nodes()[0].extra["shm"]
        finally:
            index.close()

        def notice(ns, names, secret):
            return P.SlotReads(
                namespace=ns.key.digest, tenant=ns.key.tenant, token=secret, hashes=names
            )

        ask = P.GetRequest(
            namespace=alice_ns.key.digest,
            tenant=alice_ns.key.tenant,
            token=alice,
            hashes=hashes["alice"],
            join=[False, False],
        )
        base = metrics(c, "node-0")[SLOT_READS]
        answer = asyncio.run(_notice_then_get(path, notice(alice_ns, hashes["alice"], alice), ask))
        assert isinstance(answer, P.GetPlan) and answer.ints("present") == [0, 1]
        assert metrics(c, "node-0")[SLOT_READS] == base + 2
        answer = asyncio.run(_notice_then_get(path, notice(bob_ns, hashes["bob"], alice), ask))
        assert isinstance(answer, P.GetPlan) and answer.ints("present") == [0, 1]
        assert metrics(c, "node-0")[SLOT_READS] == base + 2
        assert metrics(c, "node-0")['kvstore_errors_total{kind="slot_reads"}'] == 1
        answer = asyncio.run(
            _notice_then_get(path, notice(alice_ns, hashes["alice"], "x" * 43), ask)
        )
        assert answer is None
        assert metrics(c, "node-0")[SLOT_READS] == base + 2


def test_a_slot_read_notice_round_trips_and_refuses_what_a_get_refuses():
    """The notice encodes and decodes like a get's hashes, and names 1 to 65,536 pages."""
    frame = P.SlotReads(namespace="0" * 32, tenant="t", token="k", hashes=[bytes(16)] * 3)
    back = P.decode(P.encode(frame))
    assert isinstance(back, P.SlotReads) and back.hashes.shape == (3, 16) and back.token == "k"
    with pytest.raises(ValueError, match="1 to 65536"):
        P.SlotReads(namespace="0" * 32, tenant="t", hashes=[])
