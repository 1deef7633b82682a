"""Which index server holds a key, and one round trip per server for a batch of commands.

``kvstore.index`` builds every request as a list of ``Cmd``; a router sends them to the
server an index URL names, or to every shard of a cluster (``kvstore.index.urls`` reads
the URL forms; a cluster's slot map is read from its seeds with ``CLUSTER SLOTS``).

``run`` groups a batch by shard, sends each shard's commands as one pipeline, all
shards at once (threads for ``SyncRouter``, tasks for ``AsyncRouter``), and returns the
replies in batch order. A shard that fails (unreachable, timed out, moved slots) turns
into ``IndexUnavailableError`` values in place of its replies, so a caller can keep what
the other shards answered; the slot map is read again on the next batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.errors import (
    IndexPermissionError,
    IndexScriptError,
    IndexTimeoutError,
    IndexUnavailableError,
    KVStoreError,
)
from kvstore.index.commands import Cmd
from kvstore.index.held import HeldConnections
from kvstore.index.topology import SLOTS, Topology, topology_from_slots
from kvstore.index.urls import (
    CLUSTER_SCHEMES,
    SINGLE_SCHEMES,
    check_url,
    redact_url,
    seed_urls,
    split_password,
)

# The URL helpers, Cmd and the topology lived here before they had modules of their own;
# client/, the settings and tests still import them from this module.
__all__ = [
    "CLUSTER_SCHEMES",
    "INDEX_TIMEOUT",
    "SINGLE_SCHEMES",
    "SLOTS",
    "AsyncRouter",
    "Cmd",
    "SyncRouter",
    "Topology",
    "check_url",
    "redact_url",
    "seed_urls",
    "split_password",
]

# Seconds one index command may take before its shard counts as unavailable.
INDEX_TIMEOUT = 2.0
# A slot map is read again at most this often, however many batches fail meanwhile.
REFRESH_INTERVAL = 0.5


_TRANSIENT = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
)


def _failure(exc: Exception, url: str) -> KVStoreError:
    """What a caller sees for a failed command or shard."""
    text = str(exc)
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        # a lookup past a 50 ms budget on a loaded machine reads so too: not "unreachable"
        return IndexTimeoutError(f"Redis at {redact_url(url)} did not answer in time: {exc}")
    if isinstance(exc, (redis.ConnectionError, OSError)):
        return IndexUnavailableError(f"Redis at {redact_url(url)} is unreachable: {exc}")
    # redis-py turns these replies into their own classes and strips the prefix from
    # the text (a MOVED reply reads "2089 127.0.0.1:43967"): match both
    if (
        isinstance(exc, _TRANSIENT)
        or text.startswith(
            ("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK", "READONLY")
        )
        or "non local key" in text
    ):
        return IndexUnavailableError(
            f"Redis at {redact_url(url)} cannot serve this now ({type(exc).__name__}: {exc})"
        )  # failover or resharding
    if isinstance(exc, redis.exceptions.NoPermissionError) or text.startswith("NOPERM"):
        return IndexPermissionError(f"Redis at {redact_url(url)} refused the command: {exc}")
    return IndexScriptError(f"Redis at {redact_url(url)} rejected the request: {exc}")


def _send(client: Any, wire: list[tuple[Any, ...]]) -> list[Any]:
    """Send commands to one server (a pipeline for several); a command's error comes
    back as its reply, a connection's error is raised."""
    if len(wire) == 1:
        try:
            return [client.execute_command(*wire[0])]
        except redis.ResponseError as exc:
            return [exc]
    with client.pipeline(transaction=False) as pipe:
        for args in wire:
            pipe.execute_command(*args)
        return pipe.execute(raise_on_error=False)


async def _send_async(client: Any, wire: list[tuple[Any, ...]]) -> list[Any]:
    """``_send`` for redis.asyncio."""
    if len(wire) == 1:
        try:
            return [await client.execute_command(*wire[0])]
        except redis.ResponseError as exc:
            return [exc]
    async with client.pipeline(transaction=False) as pipe:
        for args in wire:
            pipe.execute_command(*args)
        return await pipe.execute(raise_on_error=False)


def _advance(
    steps: Generator[Any, Any, Any], reply: Any, error: BaseException | None
) -> tuple[Any, list[tuple[Any, ...]]] | None:
    """Feed a step generator the last send's replies (or throw its error in); the next
    (client, commands) to send, or None when it is done."""
    try:
        return steps.throw(error) if error is not None else steps.send(reply)
    except StopIteration:
        return None


class _Router:
    """Sends a batch of commands to the shards that hold their keys and puts the replies
    in batch order, written once for both flavours (its one job: the steps below); each
    flavour's ``_perform`` does the I/O, blocking or awaited."""

    def __init__(
        self, url: str, scripts: Sequence[Any], *, timeout: float, password: str | None, module: Any
    ) -> None:
        self.url = check_url(url)
        self.cluster = urlsplit(url).scheme in CLUSTER_SCHEMES
        self._seeds = seed_urls(url)
        self._scripts = scripts  # loaded again on NOSCRIPT
        # One bounded retry keeps every call within about 2 x timeout when a server is
        # gone. Each flavour takes its own Retry: redis-py 8.2 converts a synchronous one
        # given to an asyncio client with a UserWarning at every client start. A separate
        # password (from a Secret) overrides one in the URL.
        retry = (AsyncRetry if module is aioredis else Retry)(NoBackoff(), 1)
        self._client_kwargs: dict[str, Any] = dict(
            socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry
        )
        if password:
            self._client_kwargs["password"] = password
        self._module = module
        self._clients: dict[str, Any] = {}
        self.topology: Topology | None = None if self.cluster else Topology([url])
        self._stale = False
        self._read_at = 0.0

    def _client(self, url: str) -> Any:
        if url not in self._clients:
            self._clients[url] = self._module.Redis.from_url(url, **self._client_kwargs)
        return self._clients[url]

    def _needs_refresh(self) -> bool:
        return self.cluster and (
            self.topology is None
            or (self._stale and time.monotonic() - self._read_at > REFRESH_INTERVAL)
        )

    def _candidates(self) -> list[str]:
        known = self.topology.urls if self.topology else []
        return list(dict.fromkeys(self._seeds + known))

    def _shard_urls(self) -> list[str]:
        """The shards' addresses, by shard number: a batch runs only after ``prepare``."""
        assert self.topology is not None
        return self.topology.urls

    def _group(self, batch: Sequence[Cmd]) -> dict[int, list[int]]:
        """Batch positions per shard number."""
        topo = self.topology
        assert topo is not None
        groups: dict[int, list[int]] = {}
        for i, cmd in enumerate(batch):
            shard = (
                cmd.shard % topo.count
                if cmd.shard is not None
                else (topo.shard_of(cmd.key) if cmd.key is not None else 0)
            )
            groups.setdefault(shard, []).append(i)
        return groups

    def _wire(self, cmd: Cmd) -> tuple[Any, ...]:
        if cmd.script is None:
            return cmd.args
        return ("EVALSHA_RO" if cmd.readonly else "EVALSHA", cmd.script.sha, cmd.nkeys, *cmd.args)

    def _settle(
        self, batch: Sequence[Cmd], positions: list[int], raw: list[Any], url: str, out: list[Any]
    ) -> None:
        """Parse each reply into ``out``; errors become ``KVStoreError`` values."""
        for pos, reply in zip(positions, raw):
            if isinstance(reply, Exception):
                error = _failure(reply, url)
                if isinstance(error, IndexUnavailableError):  # failover or resharding
                    self._stale = True
                out[pos] = error
                continue
            try:
                out[pos] = batch[pos].parse(reply)
            except KVStoreError as exc:
                out[pos] = exc

    def _shard_failed(self, positions: list[int], exc: Exception, url: str, out: list[Any]) -> None:
        self._stale = True
        error = _failure(exc, url)
        for pos in positions:
            out[pos] = error

    @staticmethod
    def _noscript(reply: Any) -> bool:
        return isinstance(reply, redis.exceptions.NoScriptError)

    # The two steps below are written once as generators that yield (client, commands)
    # and get the replies back (or the send's exception thrown in); each flavour's
    # ``_perform`` does the I/O, blocking or awaited.

    def _shard_steps(
        self, batch: Sequence[Cmd], positions: list[int], url: str, out: list[Any]
    ) -> Generator[Any, Any, None]:
        """One shard's part of a batch, as one pipeline; replies land in ``out``."""
        client = self._client(url)
        try:
            raw = yield client, [self._wire(batch[p]) for p in positions]
            if missing := [k for k, reply in enumerate(raw) if self._noscript(reply)]:
                # the server lost its script cache (restart, failover, SCRIPT FLUSH)
                yield client, [("SCRIPT", "LOAD", script.source) for script in self._scripts]
                again = yield client, [self._wire(batch[positions[k]]) for k in missing]
                for k, reply in zip(missing, again):
                    raw[k] = reply
        except (redis.RedisError, OSError) as exc:
            self._shard_failed(positions, exc, url, out)
            return
        self._settle(batch, positions, raw, url, out)

    def _refresh_steps(self) -> Generator[Any, Any, None]:
        """Read the slot map from the first seed (or known shard) that answers."""
        self._read_at = time.monotonic()
        last: Exception | None = None
        for seed in self._candidates():
            try:
                reply = (yield self._client(seed), [("CLUSTER", "SLOTS")])[0]
                if isinstance(reply, Exception):
                    raise reply
                self.topology = topology_from_slots(reply, seed)
                self._stale = False
                return
            except (redis.RedisError, OSError, KVStoreError) as exc:
                last = exc
        if self.topology is None:
            raise IndexUnavailableError(f"no seed of {redact_url(self.url)} answered: {last}")


class SyncRouter(_Router):
    """The router for blocking callers (``PageIndex``), on redis-py; shards are asked from
    a thread each. Thread-safe: redis-py pools connections per server, or, with
    ``held``, connections held between calls (``HeldConnections``)."""

    def __init__(
        self,
        url: str,
        scripts: Sequence[Any],
        *,
        timeout: float = INDEX_TIMEOUT,
        password: str | None = None,
        held: HeldConnections | None = None,
    ) -> None:
        super().__init__(url, scripts, timeout=timeout, password=password, module=redis)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._held = held

    def prepare(self) -> None:
        """Read the slot map when there is none or the last batch found it stale."""
        if self._needs_refresh():
            self._refresh()

    def run(self, batch: Sequence[Cmd]) -> list[Any]:
        out: list[Any] = [None] * len(batch)
        groups, urls = self._group(batch), self._shard_urls()
        if len(groups) == 1:
            for shard, positions in groups.items():
                self._run_shard(batch, positions, urls[shard], out)
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=16, thread_name_prefix="kvstore-index"
                    )
            futures = [
                self._pool.submit(self._run_shard, batch, pos, urls[s], out)
                for s, pos in groups.items()
            ]
            for future in futures:
                future.result()
        return out

    def _run_shard(
        self, batch: Sequence[Cmd], positions: list[int], url: str, out: list[Any]
    ) -> None:
        self._perform(self._shard_steps(batch, positions, url, out))

    def _refresh(self) -> None:
        self._perform(self._refresh_steps())

    def _perform(self, steps: Generator[Any, Any, Any]) -> None:
        send = self._held.send if self._held is not None else _send
        step = _advance(steps, None, None)
        while step is not None:
            try:
                step = _advance(steps, send(*step), None)
            except (redis.RedisError, OSError) as exc:
                step = _advance(steps, None, exc)

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
        for client in self._clients.values():
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class AsyncRouter(_Router):
    """The router for asyncio callers (``AsyncPageIndex``), on redis.asyncio: shards are
    asked concurrently from the caller's event loop."""

    def __init__(
        self,
        url: str,
        scripts: Sequence[Any],
        *,
        timeout: float = INDEX_TIMEOUT,
        password: str | None = None,
    ) -> None:
        super().__init__(url, scripts, timeout=timeout, password=password, module=aioredis)
        self._refreshing: asyncio.Lock | None = None

    async def prepare(self) -> None:
        """Read the slot map when there is none or the last batch found it stale."""
        if self._needs_refresh():
            self._refreshing = self._refreshing or asyncio.Lock()
            async with self._refreshing:
                if self._needs_refresh():
                    await self._refresh()

    async def run(self, batch: Sequence[Cmd]) -> list[Any]:
        out: list[Any] = [None] * len(batch)
        groups, urls = self._group(batch), self._shard_urls()
        await asyncio.gather(
            *(self._run_shard(batch, pos, urls[s], out) for s, pos in groups.items())
        )
        return out

    async def _run_shard(
        self, batch: Sequence[Cmd], positions: list[int], url: str, out: list[Any]
    ) -> None:
        await self._perform(self._shard_steps(batch, positions, url, out))

    async def _refresh(self) -> None:
        await self._perform(self._refresh_steps())

    @staticmethod
    async def _perform(steps: Generator[Any, Any, Any]) -> None:
        step = _advance(steps, None, None)
        while step is not None:
            try:
                step = _advance(steps, await _send_async(*step), None)
            except (redis.RedisError, OSError) as exc:
                step = _advance(steps, None, exc)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
