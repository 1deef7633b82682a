"""What the servers of an embedded Valkey cluster (``EmbeddedValkeyCluster``) say about
it: whether they met and replicate (its start waits for both), which server serves
which slots now, and when a replica took over from a killed primary (fault tests)."""

from __future__ import annotations

import subprocess
import time
from typing import Generic, Protocol, TypeVar

import redis
from redis.crc import key_slot

from kvstore.errors import KVStoreError
from kvstore.index.topology import SLOTS


class Server(Protocol):
    """What this module reads of one server (``EmbeddedValkey``, which imports this
    module: a protocol keeps the import one way)."""

    port: int
    extra_args: list[str]
    process: subprocess.Popen | None

    @property
    def url(self) -> str: ...


ServerT = TypeVar("ServerT", bound=Server)  # the cluster's server class


class ClusterView(Generic[ServerT]):
    """The part of ``EmbeddedValkeyCluster`` that asks its servers; every wait ends
    with ``KVStoreError`` at its deadline."""

    shards: list[ServerT]  # the primaries as started
    servers: list[ServerT]  # the primaries, then their replicas
    replicas_per_shard: int

    def _wait_converged(self, clients: list[redis.Redis], deadline: float) -> None:
        """Until every server knows every other and the whole slot map is served.

        A MEET whose handshake does not finish within the node timeout is dropped by
        Valkey and never retried (only gossip about known nodes is), so on a loaded
        machine a server could stay alone for good: one that still knows only itself is
        met again each second (a MEET already under way is a no-op)."""
        next_meet = time.monotonic() + 1.0
        while True:
            states = [self._cluster_state(client) for client in clients]
            if all(state == ("ok", len(clients), SLOTS) for state in states):
                return
            if time.monotonic() > deadline:
                shown = ", ".join(
                    f"127.0.0.1:{s.port} {st[0]}, knows {st[1]}, serves {st[2]} slots"
                    for s, st in zip(self.servers, states)
                )
                raise KVStoreError(f"the embedded Valkey cluster did not converge ({shown})")
            if time.monotonic() > next_meet:
                for server, state in zip(self.servers[1:], states[1:]):
                    if state[1] == 1:
                        clients[0].execute_command(
                            "CLUSTER", "MEET", "127.0.0.1", server.port, cluster_port(server)
                        )
                next_meet = time.monotonic() + 1.0
            time.sleep(0.05)

    def _wait_replicating(self, clients: list[redis.Redis], deadline: float) -> None:
        """Until every replica's link to its primary is up and every server lists each
        shard with all its replicas (the primaries that vote in a failover know them)."""
        want = 3 + self.replicas_per_shard  # slot range, primary, replicas
        while True:
            links = [c.info("replication").get("master_link_status") for c in clients]
            views = [c.execute_command("CLUSTER", "SLOTS") for c in clients]
            if all(link == "up" for link in links[len(self.shards) :]) and all(
                len(entry) >= want for view in views for entry in view
            ):
                return
            if time.monotonic() > deadline:
                raise KVStoreError(
                    f"the embedded Valkey cluster's replicas did not sync (links: {links})"
                )
            time.sleep(0.05)

    @staticmethod
    def _cluster_state(client: redis.Redis) -> tuple[str, int, int]:
        """(cluster_state, known nodes, slots served) as one server sees them."""
        fields = dict(
            line.split(":", 1)
            for line in text(client.execute_command("CLUSTER", "INFO")).split()
            if ":" in line
        )
        covered = sum(int(e[1]) - int(e[0]) + 1 for e in client.execute_command("CLUSTER", "SLOTS"))
        return fields.get("cluster_state", "?"), int(fields.get("cluster_known_nodes", 0)), covered

    def slot_map(self) -> list[tuple[int, int, ServerT]]:
        """(first slot, last slot, the server serving them as primary) as the first live
        server sees them now: a killed primary stays there until a replica won."""
        for server in self.servers:
            if server.process is None or server.process.poll() is not None:
                continue
            with redis.Redis.from_url(server.url, socket_timeout=5) as client:
                ports = {s.port: s for s in self.servers}
                return [
                    (int(entry[0]), int(entry[1]), ports[int(entry[2][1])])
                    for entry in client.execute_command("CLUSTER", "SLOTS")
                ]
        raise KVStoreError("no server of the embedded Valkey cluster is running")

    def primary_for(self, key: str | int) -> ServerT:
        """The server serving ``key`` (or slot ``key``) as primary now (``slot_map``)."""
        slot = key if isinstance(key, int) else key_slot(key.encode())
        for first, last, server in self.slot_map():
            if first <= slot <= last:
                return server
        raise KVStoreError(f"no server of the embedded Valkey cluster serves slot {slot}")

    def wait_promoted(self, key: str | int, dead: ServerT, timeout: float) -> ServerT:
        """Until a server other than ``dead`` (killed by the caller) serves ``key`` as
        primary; returns it. Raises ``KVStoreError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (serving := self.primary_for(key)) is dead:
            if time.monotonic() > deadline:
                raise KVStoreError(f"no replica took over from 127.0.0.1:{dead.port} in time")
            time.sleep(0.02)
        return serving


def text(reply: object) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def cluster_port(shard: Server) -> int:
    args = shard.extra_args
    return int(args[args.index("--cluster-port") + 1])
