"""A storage node's KV events, read with vLLM's own decoder (``vllm.distributed.kv_events``)
from a real node process: what it announces per tier is what it holds.

Each test starts a node with ``--kv-events-endpoint`` and ``--kv-events-replay-endpoint``
(authenticated: a router key reading every tenant, docs/security.md), puts pages with a real client (tests/support/worker.py), and reads every batch the node sent
through the replay socket from sequence 0 (a SUB socket that connects after the node
started misses its first batches: ZMQ's slow joiner), then checks the stream against
the node's metrics and the index."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import defaultdict

import numpy as np
import pytest

from kvstore import block_hashes
from kvstore.events import PROFILES, u64_hash
from kvstore.index import PageIndex
from tests.support.helpers import (
    advertised_prefix,
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
)
from tests.support.node_events import KEYS, replay

kv_events = pytest.importorskip("vllm.distributed.kv_events")

PAGE = 256 << 10  # a 4 MiB pool holds 16 pages minus what the watermarks keep free
OPTS = {"lease_ms": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events_args(pub: int, replay: int) -> list[str]:
    return [
        "--kv-events-endpoint",
        f"tcp://*:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{replay}",
        *KEYS.node_args(),
    ]


def events_of(batches) -> list[tuple[str, object]]:
    return [(topic, e) for topic, _, batch in batches for e in batch.events]


def live_sets(events) -> dict[str, set[bytes]]:
    """Blocks per medium after applying the events in order; every removal must name a
    block announced stored in that medium before."""
    live: dict[str, set[bytes]] = defaultdict(set)
    for _, e in events:
        if isinstance(e, kv_events.BlockStored):
            live[e.medium].update(e.block_hashes)
        elif isinstance(e, kv_events.BlockRemoved):
            missing = set(e.block_hashes) - live[e.medium]
            assert not missing, (
                f"{len(missing)} blocks removed from {e.medium} before they were stored there"
            )
            live[e.medium].difference_update(e.block_hashes)
        else:
            live.clear()
    return live


def batches_of(ns, count: int, blocks: int) -> list[list[int]]:
    return [list(range(b * 100_000, b * 100_000 + blocks * ns.block_size)) for b in range(count)]


def block_tokens(ns, batches) -> dict[bytes, list[int]]:
    """Each block's token ids, by the store's hash of the block."""
    out = {}
    for b in batches:
        for i, h in enumerate(block_hashes(ns, b)):
            out[h] = b[i * ns.block_size : (i + 1) * ns.block_size]
    return out


def check_tokens(ns, stored, batches) -> None:
    """Every BlockStored carries its blocks' token ids, block_size per block, in order
    (a block known by its 16-byte hash or, under the dynamo profile, its u64)."""
    tokens = block_tokens(ns, batches)
    tokens.update({u64_hash(h): t for h, t in list(tokens.items())})
    for e in stored:
        assert (
            e.block_size == ns.block_size
            and len(e.token_ids) == len(e.block_hashes) * ns.block_size
        )
        for i, h in enumerate(e.block_hashes):
            assert e.token_ids[i * ns.block_size : (i + 1) * ns.block_size] == tokens[h]


def put_all(cluster, ns, batches) -> int:
    reports = run_worker(spec(cluster, ns, "put_pages", token_lists=batches, options=OPTS))[
        "reports"
    ]
    return sum(r["stored"] for r in reports)


@pytest.mark.parametrize("profile", ["vllm", "dynamo"])
def test_memory_stores_and_evictions_are_announced_in_order_with_vllms_decoder(clusters, profile):
    """Under either profile (``--kv-events-profile``): vllm's 16-byte page keys and
    ownership "kvstore", or dynamo's 64-bit integers of their last 8 bytes, no ownership."""
    pub, rep = free_port(), free_port()
    extra = [*events_args(pub, rep), "--kv-events-profile", profile]
    cluster = clusters(capacity="4MiB", slab="1MiB", extra=extra)
    shape = PROFILES[profile]
    ns = namespace_for_page_size(PAGE, tenant="events-mem")
    batches = batches_of(ns, 8, 4)  # 32 pages, twice the pool: the oldest are evicted
    assert put_all(cluster, ns, batches) == 32
    m = metrics(cluster, "node-0")
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_events_queued"] == 0, 10, "the queue to drain"
    )
    got = replay(rep)
    seqs = [s for _, s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in the sequence numbers"
    events = events_of(got)
    # one topic per tenant and model: kv@pool:<store id>:<tenant>@<model>
    assert {t for t, _ in events} == {f"kv@pool:node-0:{ns.tenant}@{ns.model}"}
    stored = [e for _, e in events if isinstance(e, kv_events.BlockStored)]
    removed = [e for _, e in events if isinstance(e, kv_events.BlockRemoved)]
    assert all(e.medium == "CPU" for e in stored)
    check_tokens(ns, stored, batches)
    assert all(e.parent_block_hash is None for e in stored)
    assert {e.ownership for _, e in events} == {"kvstore" if profile == "vllm" else None}
    # every page put was announced once, in the order of the puts (one batch after another)
    announced = [h for e in stored for h in e.block_hashes]
    expected = [h for b in batches for h in block_hashes(ns, b)]
    assert announced == shape.hashes(expected)
    assert all(isinstance(h, bytes if profile == "vllm" else int) for h in announced)
    # every eviction was announced, and nothing else left memory
    assert sum(len(e.block_hashes) for e in removed) == m["kvstore_evicted_pages_total"] > 0
    live = live_sets(events)["CPU"]
    assert len(live) == m["kvstore_pages"]
    index = PageIndex(cluster.redis_url)
    try:
        for b in batches:  # what the events say the node holds is what the index advertises
            hashes = block_hashes(ns, b)
            held = advertised_prefix(index, ns, hashes, lease_ms=0)
            announced_as = shape.hashes(hashes)
            assert all(h in live for h in announced_as[:held]), (
                "the index advertises a block the events removed"
            )
            if all(h in live for h in announced_as):
                assert held == len(hashes), "the events announce a block the index lacks"
    finally:
        index.close()
    assert m["kvstore_events_dropped_total"] == 0


def test_demotion_is_removed_from_cpu_and_stored_on_disk(clusters, tmp_path):
    pub, rep = free_port(), free_port()
    cluster = clusters(
        capacity="4MiB",
        slab="1MiB",
        disk_path=str(tmp_path / "disk"),
        disk_capacity="64MiB",
        extra=events_args(pub, rep),
    )
    ns = namespace_for_page_size(PAGE, tenant="events-disk")
    batches = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, batches) == 32
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_events_queued"] == 0, 10, "the queue to drain"
    )
    m = metrics(cluster, "node-0")
    events = events_of(replay(rep))
    live = live_sets(events)
    every = {h for b in batches for h in block_hashes(ns, b)}
    # nothing left the node: each page is in memory, on disk, or both, as the events say
    assert live["CPU"] | live["DISK"] == every
    assert len(live["DISK"]) == m['kvstore_tier_pages{tier="disk"}'] > 0
    assert len(live["CPU"]) == m['kvstore_tier_pages{tier="memory"}']
    check_tokens(ns, [e for _, e in events if isinstance(e, kv_events.BlockStored)], batches)
    assert {e.medium for _, e in events if isinstance(e, kv_events.BlockStored)} == {"CPU", "DISK"}
    # a demotion: stored on disk first, its memory copy removed after
    first_disk: dict[bytes, int] = {}
    for i, (_, e) in enumerate(events):
        if isinstance(e, kv_events.BlockStored) and e.medium == "DISK":
            for h in e.block_hashes:
                first_disk.setdefault(h, i)
        if isinstance(e, kv_events.BlockRemoved) and e.medium == "CPU":
            assert all(first_disk.get(h, len(events)) < i for h in e.block_hashes), (
                "memory copy removed before the disk copy"
            )
    assert m["kvstore_evicted_pages_total"] == 0


def test_a_node_restarted_without_its_disk_clears_what_it_announced(clusters):
    pub, rep = free_port(), free_port()
    cluster = clusters(capacity="4MiB", slab="1MiB", extra=events_args(pub, rep))
    ns = namespace_for_page_size(PAGE, tenant="events-restart")
    assert put_all(cluster, ns, batches_of(ns, 2, 2)) == 4
    cluster.nodes[0].kill(signal.SIGKILL)
    restarted = cluster.add_node("node-0")
    # the dead node's registry entry lives on until its TTL: wait for the new one's start line
    wait_for(lambda: "kvstore-server node=" in restarted.log(), 30, "the restarted node to start")
    got: list = []
    wait_for(lambda: got.extend(replay(rep)) or got, 10, "the restarted node's first batch")
    first_topic, first_seq, first = got[0]
    assert first_seq == 0 and isinstance(first.events[0], kv_events.AllBlocksCleared)
    cleared = {
        t for t, _, b in got if any(isinstance(e, kv_events.AllBlocksCleared) for e in b.events)
    }
    assert f"kv@pool:node-0:{ns.tenant}@{ns.model}" in cleared


def test_an_idle_node_with_events_on_uses_little_cpu(clusters):
    pub, rep = free_port(), free_port()
    cluster = clusters(capacity="4MiB", slab="1MiB", extra=events_args(pub, rep))
    ns = namespace_for_page_size(PAGE, tenant="events-idle")
    assert put_all(cluster, ns, batches_of(ns, 2, 2)) == 4
    time.sleep(1)
    pid = cluster.nodes[0].process.pid

    def cpu() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before, start = cpu(), time.monotonic()
    time.sleep(4)  # 2 % of 4 s is 8 clock ticks: enough to see a thread that spins or polls
    share = (cpu() - before) / (time.monotonic() - start)
    print(f"idle node with events on: {100 * share:.2f} % of a core")
    assert share <= 0.02


def test_token_ids_on_a_put_are_optional_and_leave_the_old_frame_unchanged():
    """A put without token ids is the frame an older client sends, byte for byte (the
    array is left off), and decodes as it did; with them, 4 bytes per token follow."""
    from kvstore.wire import protocol as P

    h = [bytes([i]) * 16 for i in range(2)]
    fields = dict(
        namespace="ab" * 16,
        tenant="t",
        hashes=h,
        sizes=[4096, 4096],
        join=[False, True],
        anchors=[h[0], h[0]],
        positions=[0, 1],
    )
    old = P.encode(P.PutRequest(**fields))
    header = P.PutRequest(**fields).model_dump_json(exclude=set(P.PutRequest.ARRAYS)).encode()
    arrays = b"".join(  # each array: its row count, then its rows
        (2).to_bytes(4, "little") + a
        for a in (
            b"".join(h),
            np.array([4096, 4096], "<u8").tobytes(),
            b"\x00\x01",
            h[0] + h[0],
            np.array([0, 1], "<u4").tobytes(),
        )
    )
    body = len(header).to_bytes(4, "little") + header
    assert old[P.PREAMBLE.size :] == body + arrays
    assert len(P.decode(old).token_ids) == 0
    new = P.encode(P.PutRequest(**fields, token_ids=list(range(32))))
    assert (
        new[: len(old)][P.PREAMBLE.size :] == old[P.PREAMBLE.size :]
        and len(new) == len(old) + 4 + 4 * 32
    )
    assert P.decode(new).ints("token_ids") == list(range(32))
    with pytest.raises(Exception, match="same number"):
        P.PutRequest(**fields, token_ids=list(range(31)))
