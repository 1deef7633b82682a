"""Section 6 of bench/events.py (``--auth-only``), its first half: authentication on
against off at the publisher (events per second, the thread's CPU per event), and what
its tables share with the second half (bench/kvevents/auth_node.py): the router's keys,
the interleaving, the rows."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

from bench.kvevents.node import node_events_run
from bench.kvevents.publisher import publisher_run
from kvstore import events as ev

AUTH_TENANT = "bench-tenant"


class RouterKeys:
    """A node's CURVE key pair and one router's, the router reading one tenant, written
    as ``kvstore events-key`` writes them (kvstore.security.routers)."""

    def __init__(self, tenant: str) -> None:
        from kvstore.security.routers import new_key_files

        self.dir = tempfile.mkdtemp(prefix="kvstore-bench-keys-")
        self.node_public, self.node_secret = new_key_files(self.dir, "node")
        router_public, self.router_secret = new_key_files(self.dir, "router")
        self.routers = os.path.join(self.dir, "routers")
        with open(self.routers, "w") as f:
            f.write(f"router {router_public} {tenant}\n")
        self.curve = (self.node_public, self.router_secret)  # what the router's socket is given

    def access(self, store_id: str):
        """A fresh ``EventAccess`` for one publisher, built as a node builds its own."""
        from kvstore.settings.events import EventSettings
        from server.events import event_access

        settings = EventSettings(
            kv_events_endpoint="tcp://*:0",
            kv_events_routers_file=self.routers,
            kv_events_key_file=self.node_secret,
        )
        return event_access(settings, store_id)

    def router_socket(self, ctx, endpoint: str):
        """A SUB connected to ``endpoint`` as the router, subscribed to everything (granted:
        its tenant's topics)."""
        import zmq

        from kvstore.events.access import curve_client

        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        curve_client(sock, *self.curve)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def interleaved(rounds: int):
    """(round, side) in the order they run: off, on, on, off, off, on, ..."""
    for r in range(rounds):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            yield r, side


def auth_row(name: str, off: list[float], on: list[float], fmt, note: str = "") -> str:
    """Each side's median (min–max), on / off of the medians and of each round."""

    def side(v: list[float]) -> str:
        return f"{fmt(statistics.median(v))} ({fmt(min(v))}–{fmt(max(v))})"

    paired = [a / b for a, b in zip(on, off) if b > 0]
    ratio = (
        f"{statistics.median(on) / statistics.median(off):.3f}"
        if statistics.median(off) > 0
        else "—"
    )
    per_round = (
        f"{statistics.median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f})" if paired else "—"
    )
    return f"| {name} | {side(off)} | {side(on)} | {ratio} | {per_round} | {note} |"


AUTH_HEADER = (
    "| {what} | authentication off, median (min–max) | on | on / off of the medians | "
    "on / off within each round, median (min–max) | {extra} |\n|---|---|---|---|---|---|"
)


def bench_auth_rates(trials: int, total: int) -> None:
    """Block events per second, authentication off (an open PUB, a plain SUB) and on
    (CURVE, an XPUB granting the router one tenant's topics, the subscriber connected
    as that router), interleaved."""
    keys = RouterKeys(AUTH_TENANT)
    topic = ev.pool_topic("bench", "llama-3-8b", AUTH_TENANT)
    small = max(total // 3, 1)
    cases = {
        "publisher, builds and publishes 32 per call": lambda a, c: publisher_run(
            total, 32, topic=topic, access=a, curve=c
        ),
        "publisher, builds and publishes 1 per call": lambda a, c: publisher_run(
            total, 1, topic=topic, access=a, curve=c
        ),
        "publisher, 32 per call built beforehand (the thread's capacity)": lambda a, c: (
            publisher_run(total, 32, prebuilt=True, topic=topic, access=a, curve=c)
        ),
        f"node's path, 32 pages per put ({total:,})": lambda a, c: node_events_run(
            total, 32, False, AUTH_TENANT, a, c
        ),
        f"node's path, 1 page per put ({small:,})": lambda a, c: node_events_run(
            small, 1, False, AUTH_TENANT, a, c
        ),
    }
    runs: dict[str, dict[str, list[dict]]] = {name: {"off": [], "on": []} for name in cases}
    try:
        for r, side in interleaved(trials):
            for name, run in cases.items():
                out = run(keys.access("bench"), keys.curve) if side == "on" else run(None, None)
                runs[name][side].append(out)
                print(
                    f"round {r} auth {side}: {name}: {out['rate']:,.0f}/s, {out.get('dropped', 0):,} dropped",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        keys.close()
    print(
        f"\n### Authentication on and off: block events per second ({trials} rounds, interleaved)\n"
    )
    print(
        f"Off: an open PUB and a plain SUB. On: CURVE, the subscriber a router whose key reads tenant {AUTH_TENANT}, "
        "subscribed to everything (granted that tenant's prefix), every event under that tenant's topic.\n"
    )
    print(
        AUTH_HEADER.format(
            what="events/s sent",
            extra="off / on: events per message; events dropped (median); subscriber got every event sent",
        )
    )
    for name, sides in runs.items():

        def got(rs: list[dict]) -> str:
            if "blocks" in rs[0]:
                return (
                    "yes"
                    if all(x["received"] is not None and x["received"] >= x["blocks"] for x in rs)
                    else "NO"
                )
            return "yes" if all(x["received"] == x["published"] for x in rs) else "NO"

        def per_message(rs: list[dict]) -> float:
            if "blocks" in rs[0]:
                return statistics.median(x["blocks"] / max(x["messages"], 1) for x in rs)
            return statistics.median(x["published"] / max(x["batches"], 1) for x in rs)

        off, on = sides["off"], sides["on"]
        window = statistics.median(x["seconds"] for x in off + on) * 1000
        dropped = f"{statistics.median(x['dropped'] for x in off):,.0f} / {statistics.median(x['dropped'] for x in on):,.0f}"
        print(
            auth_row(
                f"{name} (timed: {window:,.0f} ms)",
                [x["rate"] for x in off],
                [x["rate"] for x in on],
                lambda v: f"{v:,.0f}",
                f"{per_message(off):,.0f} / {per_message(on):,.0f}; {dropped}; {got(off)} / {got(on)}",
            )
        )
    print(
        "\nThe publisher thread's own time on a CPU per event it sent (``/proc/<pid>/task/<tid>/schedstat``: the thread's "
        "work, whatever else the cores ran meanwhile):\n"
    )
    print(AUTH_HEADER.format(what="publisher thread, ns of CPU per event sent", extra="note"))
    for name, sides in runs.items():
        sent = "blocks" if "blocks" in sides["off"][0] else "published"
        print(
            auth_row(
                name,
                [x["thread_ns"] / x[sent] for x in sides["off"]],
                [x["thread_ns"] / x[sent] for x in sides["on"]],
                lambda v: f"{v:,.0f}",
            )
        )
