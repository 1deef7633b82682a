"""kvstore.events: the vLLM KV-event format and the bounded publisher a storage node uses,
checked with vLLM's own types (``vllm.distributed.kv_events``) and, for replay, beside
vLLM's own ``ZmqEventPublisher``."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvstore import events as ev
from tests.support.kv_events_fixtures import (  # noqa: F401 (fixtures)
    Reader,
    connected,
    publisher,
    stored,
    vllm_decoder,
    wait_until,
)

vk = pytest.importorskip("vllm.distributed.kv_events")

TOPIC = ev.pool_topic("store-1", "llama-3-8b")


def test_events_are_the_bytes_vllm_encodes_and_decode_with_vllms_types():
    """Each kind, with hashes as bytes and as ints, the optional fields set and left out,
    a batch with and without a data-parallel rank: the same bytes as vLLM's classes give,
    decoded by vLLM's decoder to equal vLLM objects."""
    h = [bytes([i]) * 32 for i in range(3)]
    ours = [
        ev.block_stored(
            h[1:],
            list(range(32)),
            16,
            parent_block_hash=h[0],
            lora_name="adapter",
            lora_id=7,
            extra_keys=[("adapter",), None],
        ),
        ev.block_stored(
            [11, 12], list(range(8)), 4, medium=ev.MEDIUM_STORAGE, locality=ev.LOCAL, ownership=None
        ),
        ev.block_removed([11, 12], medium=ev.MEDIUM_CPU),
        ev.AllBlocksCleared(),
    ]
    theirs = [
        vk.BlockStored(
            block_hashes=h[1:],
            parent_block_hash=h[0],
            token_ids=list(range(32)),
            block_size=16,
            lora_id=7,
            medium="CPU",
            lora_name="adapter",
            extra_keys=[("adapter",), None],
            ownership="kvstore",
        ),
        vk.BlockStored(
            block_hashes=[11, 12],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="STORAGE",
            lora_name=None,
            locality="LOCAL",
        ),
        vk.BlockRemoved(block_hashes=[11, 12], medium="CPU", ownership="kvstore"),
        vk.AllBlocksCleared(),
    ]
    for rank in (None, 3):
        ours_bytes = msgspec.msgpack.encode(
            ev.EventBatch(ts=1234.5, events=ours, data_parallel_rank=rank)
        )
        theirs_bytes = msgspec.msgpack.encode(
            vk.KVEventBatch(ts=1234.5, events=theirs, data_parallel_rank=rank)
        )
        assert ours_bytes == theirs_bytes
        decoded = vllm_decoder().decode(ours_bytes)
        assert decoded.events == theirs and decoded.data_parallel_rank == rank
    # the wire shape routers parse: [ts, events, rank] (array-like structs keep every
    # field), each event a map tagged by its kind, without the fields at their defaults
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(ev.EventBatch(ts=1.0, events=ours[2:])))
    assert raw == [
        1.0,
        [
            {
                "type": "BlockRemoved",
                "block_hashes": [11, 12],
                "medium": "CPU",
                "ownership": "kvstore",
            },
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]


def test_field_order_and_defaults_match_vllms_structs():
    """The golden check of the structs themselves: a vLLM upgrade that adds, moves or
    re-defaults a field fails here."""
    for ours, theirs in (
        (ev.BlockStored, vk.BlockStored),
        (ev.BlockRemoved, vk.BlockRemoved),
        (ev.AllBlocksCleared, vk.AllBlocksCleared),
        (ev.EventBatch, vk.EventBatch),
    ):
        assert ours.__struct_fields__ == theirs.__struct_fields__, ours
        assert ours.__struct_defaults__ == theirs.__struct_defaults__, ours
        for option in ("array_like", "omit_defaults", "tag", "tag_field"):
            assert getattr(ours.__struct_config__, option) == getattr(
                theirs.__struct_config__, option
            ), (ours, option)


def test_a_stored_event_must_carry_its_blocks_tokens_and_a_topic_its_parts():
    with pytest.raises(ValueError, match="2 blocks of 16 tokens need 32 token ids, got 31"):
        ev.block_stored([1, 2], list(range(31)), 16)
    assert TOPIC == "kv@pool:store-1@llama-3-8b"
    for store, model in (("a@b", "m"), ("s", ""), ("", "m")):
        with pytest.raises(ValueError):
            ev.pool_topic(store, model)


def test_options_refuse_unbounded_queues():
    from pydantic import ValidationError

    for bad in ({"hwm": 0}, {"max_queue_events": 0}, {"replay_bytes": "-1"}, {"mode": "listen"}):
        with pytest.raises(ValidationError):
            ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", **bad)
    assert (
        ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", replay_bytes="8MiB").replay_bytes
        == 8 << 20
    )


# ---- the publisher -------------------------------------------------------------------


def test_batches_arrive_in_three_frames_in_order_with_consecutive_sequence_numbers(publisher):
    """[topic, u64 big-endian sequence, payload]: sequence from 0, one per batch; every
    event, in publish order, decoded by vLLM's types; a call's events stay together."""
    pub = publisher(data_parallel_rank=None)
    reader = Reader(pub.endpoint)
    try:
        connected(pub, reader)
        before = pub.stats()
        first = before.next_sequence
        calls = [[stored(i, parent=i - 1 if i else None)] for i in range(50)] + [
            [stored(100 + i) for i in range(10)]
        ]
        for call in calls:
            assert pub.publish(call)
        wait_until(lambda: len(reader.events()) == 60)
        assert {topic for topic, _, _ in reader.messages} == {TOPIC.encode()}
        seqs = [seq for _, seq, _ in reader.messages]
        assert seqs == list(range(first, first + len(seqs)))
        got = reader.events()
        assert got == [vk.BlockStored(**msgspec.structs.asdict(e)) for call in calls for e in call]
        assert all(len(vllm_decoder().decode(p).events) for _, _, p in reader.messages)
        last = vllm_decoder().decode(reader.messages[-1][2])
        assert last.data_parallel_rank is None and [e.block_hashes[0] for e in last.events][
            -10:
        ] == list(range(100, 110))
        stats = pub.stats()
        assert (
            stats.published_events - before.published_events == 60
            and stats.dropped_events == 0
            and stats.skipped_sequences == 0
        )
    finally:
        reader.close()


def test_a_publisher_connects_to_a_subscriber_that_binds(publisher):
    """llm-d's manager binds and engines connect: mode "connect" (and "auto" for a host
    address, as vLLM decides)."""
    reader = Reader(None)
    try:
        pub = publisher(endpoint=reader.endpoint, mode="auto")
        assert pub.endpoint == reader.endpoint
        connected(pub, reader)
        pub.publish([stored(5)])
        wait_until(lambda: reader.events() == [vk.BlockStored(**msgspec.structs.asdict(stored(5)))])
    finally:
        reader.close()


def test_replay_answers_as_vllms_publisher_does(publisher):
    """The same replay request to vLLM's ZmqEventPublisher and to ours: the same frames
    (identity, empty, topic, sequence, payload) for every batch from the asked sequence
    on, then the end marker (empty, empty, -1, empty); the payloads decode to the same
    events."""
    pub = publisher(replay_endpoint="tcp://127.0.0.1:0")
    theirs = vk.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="inproc://vllm-publisher",
        replay_endpoint="tcp://127.0.0.1:0",
        topic=TOPIC,
    )
    try:
        their_replay = theirs._replay.getsockopt_string(
            zmq.LAST_ENDPOINT
        )  # vLLM reports the ":0" it was given
        batches = [[stored(3 * i + k) for k in range(3)] for i in range(5)]
        for i, batch in enumerate(batches):
            assert pub.publish(batch)
            wait_until(
                lambda: pub.stats().next_sequence == i + 1
            )  # one batch each: published one at a time
            theirs.publish(
                vk.KVEventBatch(
                    ts=time.time(),
                    events=[vk.BlockStored(**msgspec.structs.asdict(e)) for e in batch],
                )
            )
        wait_until(lambda: theirs._event_queue.unfinished_tasks == 0)

        def replay(endpoint: str, start: int) -> list[list[bytes]]:
            ctx = zmq.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == ev.END_SEQ:
                    break
            dealer.close(linger=0)
            ctx.term()
            return frames

        ours_frames, their_frames = replay(pub.replay_endpoint, 2), replay(their_replay, 2)
        assert [f[:3] for f in ours_frames] == [
            f[:3] for f in their_frames
        ]  # empty, topic, sequence
        assert [int.from_bytes(f[2], "big") for f in ours_frames[:-1]] == [2, 3, 4]
        assert ours_frames[-1] == [b"", b"", ev.END_SEQ, b""]
        decoder = vllm_decoder()
        assert [decoder.decode(f[3]).events for f in ours_frames[:-1]] == [
            decoder.decode(f[3]).events for f in their_frames[:-1]
        ]
        assert pub.stats().replay_requests == 1
        assert replay(pub.replay_endpoint, 99) == [
            [b"", b"", ev.END_SEQ, b""]
        ]  # past the newest: the end marker only
    finally:
        theirs.shutdown()


def test_the_dynamo_profile_turns_hashes_into_the_integers_vllm_publishes(monkeypatch):
    """``u64_hash`` of a byte hash is what vLLM publishes for it under
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (so a node's and an engine's int hashes are made
    alike); the vllm profile leaves hashes and marks as they are."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    hashes = [bytes(range(i, i + 16)) for i in (0, 200)] + [b"\xff" * 32]
    assert [ev.u64_hash(h) for h in hashes] == [maybe_convert_block_hash(h) for h in hashes]
    assert ev.u64_hash(5) == 5 and ev.u64_hash(-1) == (1 << 64) - 1
    dynamo, plain = ev.PROFILES["dynamo"], ev.PROFILES["vllm"]
    assert dynamo.hashes(hashes) == [ev.u64_hash(h) for h in hashes]
    assert (dynamo.ownership, dynamo.remote) == (None, None)
    assert plain.hashes(hashes) is hashes
    assert (plain.ownership, plain.remote) == (ev.OWNERSHIP, ev.REMOTE)
