"""How an index method reaches the servers: every method of ``PageIndex`` and
``AsyncPageIndex`` is written once, as a function that returns a generator (``Steps``)
which yields batches of commands (``kvstore.index.routing.Cmd``) and gets their replies
back; the flavour's ``drive`` sends each batch, blocking or awaited, so the two flavours
cannot drift apart. ``driven`` makes such a function the method, typed per flavour: on
a ``PageIndex`` it returns the answer, on an ``AsyncPageIndex`` an awaitable of it.

The method modules (``lookups``, ``publish``, ``registry``) build on ``IndexDriver``
and use the reply helpers below. A caller that asks the index as one step of its own
steps (``client.lookups.prefix``) composes the generator (``yield from``) and drives
the whole with the flavour's ``drive``: one pattern from the client to the wire."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

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

T = TypeVar("T")
P = ParamSpec("P")
# An index method's steps: yields batches of commands, gets each batch's replies (in
# order, an error as its reply), returns the method's answer.
Steps = Generator[list[Cmd], list[Any], T]


def text(value: Any) -> str:
    """A reply's string, whichever way the client decoded it."""
    return value.decode() if isinstance(value, bytes) else str(value)


def raise_first(replies: list[Any]) -> list[Any]:
    """The replies, or the first error among them raised."""
    for reply in replies:
        if isinstance(reply, KVStoreError):
            raise reply
    return replies


def single(cmd: Cmd) -> Steps[Any]:
    """A method of one command: its parsed reply, or its error raised."""
    return raise_first((yield [cmd]))[0]


class BlockingIndex(Protocol):
    """The blocking flavour as ``driven`` sees it (``PageIndex``: it imports this
    module, so the type is described here, not imported)."""

    def drive(self, steps: Steps[Any]) -> Any: ...
    def close(self) -> None: ...


class AwaitingIndex(Protocol):
    """The asyncio flavour as ``driven`` sees it (``AsyncPageIndex``)."""

    async def drive(self, steps: Steps[Any]) -> Any: ...
    async def close(self) -> None: ...


class driven(Generic[P, T]):
    """Makes ``steps``, a function of an ``IndexDriver`` that returns a method's
    ``Steps``, that method: ``PageIndex`` (blocking) returns its answer (``T``),
    ``AsyncPageIndex`` an awaitable of it, and mypy knows which. What ``steps`` does
    before its generator starts (checking its arguments) runs at the call, in both
    flavours; the generator runs once the flavour knows the shards (``drive``).

    At class creation (``__set_name__``) it puts a plain function in its place, so a
    call costs one frame more than a hand-written method and no descriptor lookup: the
    lookup hot path (bench/lookup.py). That function keeps ``steps``' name and
    docstring for ``help()``; ``steps`` stays reachable as its ``steps`` attribute."""

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[T]]) -> None:
        self.steps = steps

    def method(self, name: str | None = None) -> Callable[..., Any]:
        """The plain function that stands for the method (named ``name``): drives
        ``steps``' generator."""
        steps = self.steps

        @functools.wraps(steps)
        def method(index: IndexDriver, *args: Any, **kwargs: Any) -> Any:
            return index.drive(steps(index, *args, **kwargs))

        if name is not None:  # help() and tracebacks name the method, not its steps
            method.__name__ = name
            method.__qualname__ = f"{steps.__qualname__.rpartition('.')[0]}.{name}"
        # help() shows the arguments but not ``Steps``: the method's answer is the
        # steps' answer, or an awaitable of it, by flavour
        method.__annotations__ = {k: v for k, v in steps.__annotations__.items() if k != "return"}
        method.__signature__ = inspect.signature(steps).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.Signature.empty
        )
        method.steps = steps  # type: ignore[attr-defined]
        return method

    def __set_name__(self, owner: type, name: str) -> None:
        setattr(owner, name, self.method(name))

    @overload
    def __get__(self, index: None, owner: type) -> driven[P, T]: ...
    @overload
    def __get__(self, index: BlockingIndex, owner: type) -> Callable[P, T]: ...
    @overload
    def __get__(self, index: AwaitingIndex, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, index: IndexDriver, owner: type) -> Callable[P, Any]: ...

    def __get__(self, index: Any, owner: type) -> Any:
        # Only reached when the decorator was applied outside a class body (no
        # ``__set_name__``): bind the same function.
        return self if index is None else self.method().__get__(index, owner)


class IndexDriver:
    """Sends an index method's batches to the index servers and feeds the replies back
    (its one job): the flavours differ only in ``drive``, which ``PageIndex`` runs
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

    def drive(self, steps: Steps[Any]) -> Any:
        """Run ``steps`` to its answer: blocking (``PageIndex``) or as an awaitable
        (``AsyncPageIndex``). Callers: the ``driven`` methods, and a caller that
        composes a method's steps into its own (``client.lookups.prefix``)."""
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

    def _ping(self) -> Steps[None]:
        """Raise ``IndexUnavailableError`` unless every shard answers."""
        raise_first((yield self._all_shards("PING")))

    ping = driven(_ping)

    def _server_ids(self) -> Steps[dict[str, str | None]]:
        """Each shard's run id by address, None for a shard that did not answer. A run id
        changes whenever a server restarts, and a failover puts a new address in the map:
        both tell nodes that the index may have lost or rolled back what they published.
        Raises ``IndexUnavailableError`` only when no shard answered."""
        topo = self._router.topology
        assert topo is not None
        infos = yield self._all_shards("INFO", "server")
        if all(isinstance(info, KVStoreError) for info in infos):
            raise infos[0]
        return {
            url: None if isinstance(info, KVStoreError) else str(info.get("run_id", ""))
            for url, info in zip(topo.urls, infos)
        }

    server_ids = driven(_server_ids)
