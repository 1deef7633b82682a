"""How an index method reaches the servers: every method of ``PageIndex`` and
``AsyncPageIndex`` is written once, as a generator that yields batches of commands
(``kvstore.index.routing.Cmd``) and gets their replies back; ``IndexDriver._drive``
sends each batch, blocking or awaited, so the two flavours cannot drift apart.

The method modules (``lookups``, ``publish``, ``registry``) build on ``IndexDriver``
and use the reply helpers below."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.index.commands import Cmd
from kvstore.index.lease_clock import LeaseClock
from kvstore.index.routing import AsyncRouter, SyncRouter
from kvstore.pages import keys

# A reader's lease on the segments it looked up (lookups.renew_below has the rule).
DEFAULT_LEASE_MS = 5_000
# A segment key expires this long after its last commit or lease renewal: records of
# nodes that are gone for good do not stay in the index forever.
DEFAULT_ENTRY_TTL_MS = 24 * 3600 * 1000

Steps = Generator[list[Cmd], list[Any], Any]


def text(value: Any) -> str:
    """A reply's string, whichever way the client decoded it."""
    return value.decode() if isinstance(value, bytes) else str(value)


def raise_first(replies: list[Any]) -> list[Any]:
    """The replies, or the first error among them raised."""
    for reply in replies:
        if isinstance(reply, KVStoreError):
            raise reply
    return replies


def single(cmd: Cmd) -> Steps:
    """A method of one command: its parsed reply, or its error raised."""
    return raise_first((yield [cmd]))[0]


class IndexDriver:
    """Sends an index method's batches to the index servers and feeds the replies back
    (its one job): the flavours differ only in ``_drive``, which ``PageIndex`` runs
    blocking and ``AsyncPageIndex`` as an awaitable. Also the calls about the servers
    themselves, which ask every shard (``ping``, ``server_ids``)."""

    def __init__(
        self,
        url: str,
        router: SyncRouter | AsyncRouter,
        *,
        lease_ms: int = DEFAULT_LEASE_MS,
        entry_ttl_ms: int = DEFAULT_ENTRY_TTL_MS,
    ) -> None:
        self.url = url
        self.lease_ms = lease_ms
        self.entry_ttl_ms = entry_ttl_ms
        self._router = router
        self.leases = LeaseClock()  # when the leases its lookups saw fall due (lookups.py)

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis/Valkey Cluster."""
        return self._router.cluster

    @property
    def shards(self) -> int:
        """Index servers (shards) as last read from the slot map; 0 before the first call."""
        return self._router.topology.count if self._router.topology else 0

    def _drive(self, steps: Steps) -> Any:
        raise NotImplementedError

    def _all_shards(self, *args: Any, parse: Any = lambda raw: raw) -> list[Cmd]:
        topo = self._router.topology
        assert topo is not None
        return [Cmd(args, shard=i, parse=parse) for i in range(topo.count)]

    def _anchors_by_shard(self, prefix: str, anchors: Sequence[bytes]) -> dict[int, list[int]]:
        """Segment numbers (indexes into ``anchors``) per shard, in order."""
        topo = self._router.topology
        assert topo is not None
        if topo.count == 1:
            return {0: list(range(len(anchors)))}
        by_shard: dict[int, list[int]] = {}
        for j, anchor in enumerate(anchors):
            by_shard.setdefault(topo.shard_of(keys.segment_key(prefix, anchor)), []).append(j)
        return by_shard

    def ping(self) -> Any:
        """Raise ``IndexUnavailableError`` unless every shard answers."""

        def steps() -> Generator[list[Cmd], list[Any], None]:
            raise_first((yield self._all_shards("PING")))

        return self._drive(steps())

    def server_ids(self) -> Any:
        """Each shard's run id by address, None for a shard that did not answer. A run id
        changes whenever a server restarts, and a failover puts a new address in the map:
        both tell nodes that the index may have lost or rolled back what they published.
        Raises ``IndexUnavailableError`` only when no shard answered."""

        def steps() -> Generator[list[Cmd], list[Any], dict[str, str | None]]:
            topo = self._router.topology
            assert topo is not None
            infos = yield self._all_shards("INFO", "server")
            if all(isinstance(info, KVStoreError) for info in infos):
                raise infos[0]
            return {
                url: None if isinstance(info, KVStoreError) else str(info.get("run_id", ""))
                for url, info in zip(topo.urls, infos)
            }

        return self._drive(steps())
