"""The event publisher under load: its replay window's bounds, drops counted with one
sequence gap per run, bounded bursts, a subscriber that stops reading, close, and an
idle publisher's CPU."""

from __future__ import annotations

import time

import zmq

from kvstore import events as ev
from tests.support.kv_events_fixtures import Reader, connected, publisher, stored, wait_until  # noqa: F401 (fixtures)


def test_replay_window_keeps_the_newest_batches_within_its_bounds(publisher):
    pub = publisher(replay_endpoint="tcp://127.0.0.1:0", replay_batches=3)
    for i in range(6):
        pub.publish([stored(i)])
        wait_until(lambda: pub.stats().next_sequence == i + 1)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        if frames[2] == ev.END_SEQ:
            break
        seqs.append(int.from_bytes(frames[2], "big"))
    dealer.close(linger=0)
    ctx.term()
    assert seqs == [3, 4, 5]


def test_drops_are_counted_and_leave_one_sequence_gap_per_run(publisher):
    """A call that does not fit the queue is dropped whole and counted; the batch it
    would have gone into consumes a sequence number, so the subscriber sees the gap;
    publishing goes on after it."""
    pub = publisher(max_queue_events=10)
    reader = Reader(pub.endpoint)
    try:
        connected(pub, reader)
        first = pub.stats().next_sequence
        assert pub.publish([stored(1)])
        wait_until(lambda: pub.stats().next_sequence == first + 1)
        assert not pub.publish([stored(i) for i in range(11)])  # more than the queue holds
        # the thread takes the gap before the next drop (CI once saw this order by chance)
        wait_until(lambda: pub.stats().next_sequence == first + 2)
        assert not pub.publish(
            [stored(i) for i in range(12)]
        )  # the same run of drops: no second gap
        assert pub.publish([stored(2)])
        wait_until(lambda: len(reader.messages) == 2)
        assert [seq for _, seq, _ in reader.messages] == [first, first + 2]
        assert [e.block_hashes for e in reader.events()] == [[1], [2]]
        stats = pub.stats()
        assert (stats.dropped_events, stats.skipped_sequences, stats.next_sequence) == (
            23,
            1,
            first + 3,
        )
    finally:
        reader.close()


def test_a_burst_is_bounded_and_every_gap_is_a_drop(publisher):
    """200,000 one-event calls as fast as one thread can make them into a queue of 1,000:
    the queue never holds more than its bound, what was not dropped arrives (a reading
    subscriber), and the missing sequence numbers are exactly the skipped ones."""
    pub = publisher(max_queue_events=1000, max_batch_events=256)
    reader = Reader(pub.endpoint, hwm=0)
    try:
        connected(pub, reader)
        before = pub.stats()
        first = before.next_sequence
        peak = 0
        events = [stored(i) for i in range(200_000)]
        for i, event in enumerate(events):
            pub.publish([event])
            if i % 1000 == 0:
                peak = max(peak, pub.stats().queued_events)
        wait_until(lambda: pub.stats().queued_events == 0)
        stats = pub.stats()
        published = stats.published_events - before.published_events
        wait_until(
            lambda: len(reader.messages) == stats.published_batches - before.published_batches
        )
        assert peak <= 1000
        assert published + stats.dropped_events == 200_000
        assert len(reader.events()) == published
        seqs = [seq for _, seq, _ in reader.messages]
        missing = set(range(first, stats.next_sequence)) - set(seqs)
        assert len(missing) == stats.skipped_sequences and (stats.dropped_events > 0) == (
            stats.skipped_sequences > 0
        )
        assert seqs == sorted(seqs)
        print(
            f"burst: {stats.dropped_events} of 200,000 events dropped, {stats.skipped_sequences} gaps, peak queue {peak}"
        )
    finally:
        reader.close()


def test_a_subscriber_that_stops_reading_never_blocks_or_grows_the_publisher(publisher):
    """A SUB that reads nothing, with small high-water marks on both sides: the publisher
    sends everything it accepted without waiting, and drops nothing itself (ZMQ drops
    for that subscriber)."""
    pub = publisher(hwm=10)
    stalled = Reader(pub.endpoint, hwm=10, read=False)
    try:
        time.sleep(0.2)
        started = time.monotonic()
        for i in range(50_000):
            pub.publish([stored(i)])
        wait_until(lambda: pub.stats().queued_events == 0, 20)
        assert time.monotonic() - started < 20
        stats = pub.stats()
        assert stats.published_events == 50_000 and stats.dropped_events == 0
    finally:
        stalled.close()


def test_close_sends_what_was_queued_and_later_publishes_are_dropped(publisher):
    pub = publisher()
    reader = Reader(pub.endpoint)
    try:
        connected(pub, reader)
        for i in range(100):
            pub.publish([stored(i)])
        pub.close()
        wait_until(lambda: len(reader.events()) == 100)
        assert not pub.publish([stored(1)]) and pub.stats().dropped_events == 1
    finally:
        reader.close()


def test_an_idle_publisher_uses_no_cpu(publisher):
    """At most 2 % of a core while idle, replay socket included (measured: the process's
    CPU time over 3 s while nothing is published; this thread sleeps)."""
    pub = publisher(replay_endpoint="tcp://127.0.0.1:0")
    reader = Reader(pub.endpoint)
    try:
        connected(pub, reader)
        time.sleep(0.2)
        reader.stop_reading()  # the test's own reader polls; stop it first
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(3)
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        assert share <= 0.02, share
        print(f"idle publisher: {share * 100:.3f} % of a core")
    finally:
        reader.close()
