"""What bench/events.py's sections (bench/kvevents/) share: the repository root, a page's
token count, a figure as median (min-max), a process's CPU time per thread from /proc,
the subscriber loop their subscriber processes run (``event_batches``), and the
namespace of the node sections' puts (``events_namespace``)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


BLOCK_TOKENS = 16  # a node's page of an 8B model: 2 MiB, 16 tokens (64 bytes of token ids)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def cpu_ns(pid: int, tids: list[int] | None = None) -> dict[int, int]:
    """Nanoseconds on a CPU per thread of ``pid`` (``/proc/<pid>/task/<tid>/schedstat``:
    exact, where ``cpu_seconds`` counts clock ticks of 10 ms)."""
    out = {}
    for tid in tids if tids is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            pass  # the thread ended
    return out


def event_batches(endpoint: str, conn: Any, curve: tuple[str, str] | None) -> Iterator[list]:
    """In a subscriber process: every decoded batch of events published at ``endpoint``,
    up to and including the one holding the end marker (an AllBlocksCleared), or until
    30 s pass without one. Tells ``conn`` "connected" once subscribed and "joined" at the
    first batch. ``curve``: (the node's public key, a router's secret key file): connect
    as that router (section 6)."""
    import zmq

    from kvstore import events as ev

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        from kvstore.events.access import curve_client

        curve_client(sub, *curve)
    sub.connect(endpoint)
    decoder = ev.decoder()
    conn.send("connected")
    joined = False
    try:
        while sub.poll(30_000):
            _, _, payload = sub.recv_multipart()
            batch = decoder.decode(payload).events
            if not joined:
                joined = True
                conn.send("joined")
            yield batch
            if any(isinstance(e, ev.AllBlocksCleared) for e in batch):
                break
    finally:
        sub.close(linger=0)
        ctx.term()


def events_namespace(tenant: str) -> Any:
    """The namespace of the node sections' puts: 256 KiB pages."""
    from kvstore.pages.namespace import Namespace

    return Namespace(
        model="bench-events",
        dtype="float16",
        num_layers=8,
        num_kv_heads=1,
        head_size=32,
        block_size=256,
        tenant=tenant,
    )
