"""``KVCacheClient``: the blocking twin of ``AsyncKVCacheClient`` (same method names).

Every ``KVCacheClient`` in a process runs its ``AsyncKVCacheClient`` on one shared
event loop in a daemon thread, which is also the only thread that drives UCX progress
(a ucxx worker must not be progressed from two threads). Lookups (``find``,
``lookup``) only talk to the index: they take the async client's lookup path
(``client.lookups.prefix.PrefixLookup``) in the caller's thread, over an index connection of
their own, sparing the hop to the loop. Every call waits at most a
bound derived from the client timeout, so a wedged transfer cannot hang the caller.
A call that passes its bound is cancelled, and it returns only once the cancelled
work has unwound (its endpoints closed), so nothing lands in the caller's tensors
after the call returned. Do not mix ``KVCacheClient`` and ``AsyncKVCacheClient`` on
another loop in one process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch

from client.async_client import AsyncKVCacheClient
from client.control import ControlCalls
from client.gets.plan import (
    GetPlan,
    device_plan,
    found_plan,
    pages_plan,
    spans_plan,
    units_plan,
)
from client.gets.views import blocking_view
from client.lookups.prefix import Identity, Ready
from client.lookups.stored_prefix import StoredPrefix
from client.puts.plan import PutPlan, keyed_put_plan, pages_put_plan
from client.puts.publish import PublishReport
from client.puts.views import blocking_put_view
from client.stats import ClientStats
from kvstore.errors import TransportError
from kvstore.index import PageIndex
from kvstore.index.driver import Steps
from kvstore.index.lookups import LookupMethods
from kvstore.index.routing import INDEX_TIMEOUT
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import client_options_from_env

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

log = logging.getLogger(__name__)
_MARGIN = 10.0
# How long a cancelled call may take to unwind; it only closes endpoints, so this is
# never reached in practice, and passing it is logged as a bug.
_UNWIND_SECONDS = 30.0
_shared_loop: asyncio.AbstractEventLoop | None = None
_shared_lock = threading.Lock()


def _client_loop() -> asyncio.AbstractEventLoop:
    """The process-wide loop of blocking clients, started on first use."""
    global _shared_loop
    with _shared_lock:
        if _shared_loop is None:
            _shared_loop = asyncio.new_event_loop()
            threading.Thread(
                target=_shared_loop.run_forever, name="kvstore-client", daemon=True
            ).start()
        return _shared_loop


@dataclass(frozen=True)
class StartStatus:
    """``KVCacheClient.start_status``."""

    index_reached: bool
    index_error: str | None
    nodes: list[str]
    refused: dict[str, str]  # node id -> why it refused the client's token in the start probe


class KVCacheClient(ControlCalls):
    """One job: ``AsyncKVCacheClient`` for blocking callers: each call runs on the
    process's client loop within a bound (module docstring), lookups in the caller's
    thread. Same constructor as ``AsyncKVCacheClient``: options as keywords or
    ``options=``."""

    def __init__(
        self, redis_url: str | None = None, namespace: Namespace | None = None, **options: Any
    ) -> None:
        self._loop = _client_loop()
        self._closed = False
        client = AsyncKVCacheClient(
            redis_url, namespace, **options
        )  # validates options here, in the caller
        self._async = self._run(client.start(), _MARGIN + 30)
        # socket timeout -> the caller's own index (``find``)
        self._indexes: dict[float, PageIndex] = {}
        self._index_lock = threading.Lock()

    @classmethod
    def from_env(cls, namespace: Namespace | None = None, **overrides: Any) -> KVCacheClient:
        """Build from KVSTORE_* variables (see ``ClientSettings``); keyword overrides win.
        The same as the constructor without ``options=``."""
        return cls(None, namespace, options=client_options_from_env(), **overrides)

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        task: list[asyncio.Task] = []

        async def tracked() -> Any:
            current = asyncio.current_task()
            if current is not None:
                task.append(current)
            return await coro

        future = asyncio.run_coroutine_threadsafe(tracked(), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Cancel the task itself (not just this future) and wait until it has
            # unwound: cancellation closes the endpoints of every transfer the call
            # started, so no receive can write into the caller's memory afterwards.
            self._loop.call_soon_threadsafe(lambda: task and task[0].cancel())
            done, _ = concurrent.futures.wait([future], _UNWIND_SECONDS)
            if not done:
                log.error("a cancelled client call has not unwound after %.0f s", _UNWIND_SECONDS)
            raise TransportError(f"client call did not finish within {timeout:.1f} s") from None

    @property
    def namespace(self) -> Namespace:
        return self._async.namespace

    def start_status(self) -> StartStatus:
        """What this client reached at start (and since): whether the index answered
        (the namespace is registered), why not, and the live nodes it last read. For a
        caller's start-up line; asks nothing."""
        inner = self._async
        return StartStatus(
            inner.namespace_registered,
            inner.namespace_error,
            [n.node_id for n in inner.nodes.last()],
            dict(inner.nodes.refused_at_start),
        )

    @property
    def stats(self) -> ClientStats:
        return self._async.stats

    @property
    def call_limit(self) -> float:
        """The longest a blocking call of this client waits before it gives up (a get
        ends by then, with what arrived)."""
        return self._bound()

    def _bound(self) -> float:
        return self._async.timeout * 3 + _MARGIN

    def _read(self, coro: Any, miss: Any, timeout: float | None = None) -> Any:
        """Reads turn even the outer deadline into a miss: remote faults never raise."""
        try:
            return self._run(coro, self._bound() if timeout is None else timeout)
        except TransportError as exc:
            log.warning("read gave up, counting it as a miss: %s", exc)
            return miss

    def lookup(self, token_ids: Any, *, identity: Identity = None) -> int:
        """Tokens of ``token_ids`` covered by stored full blocks, in one index round
        trip (``find``); an index fault counts as 0. ``identity``: what else the
        request's KV depends on (``kvstore.pages.identity.RequestIdentity``)."""
        found = self.find(token_ids, identity=identity)
        return found.tokens if found else 0

    def lookup_checked(
        self, token_ids: Any, timeout: float | None = None, *, identity: Identity = None
    ) -> int | None:
        """``lookup``, but None when the index could not answer within ``timeout``
        seconds (``find``)."""
        found = self.find(token_ids, timeout, identity=identity)
        return None if found is None else found.tokens

    def find(
        self,
        token_ids: Any,
        timeout: float | None = None,
        *,
        identity: Identity = None,
        last: bool = False,
    ) -> StoredPrefix | None:
        """``AsyncKVCacheClient.find`` within ``timeout`` seconds (the client's index
        timeout when None); past it the lookup gives None.

        Asked in the caller's thread, over an index connection of its own: the hop to
        the client's loop thread and back cost 0.14 ms, a third of a 16-block lookup
        (0.55 ms through the loop against 0.39 ms on it; bench/lookup.py). Each read of
        the index then waits at most ``timeout``. The node list comes from the client's
        directory, which reads the registry in the background: a lookup after a pause
        no longer reads it in its own round trip (paused lookups in bench/lookup.py).
        When the list went stale while the client was idle
        (``client.nodes.directory.KEEP_FRESH_S``), the lookup reads the registry in its
        one round trip; until the namespace is registered, the call goes through the
        loop, which registers it first. ``last``: a chain stored at some blocks only
        (``PrefixLookup.find_steps``)."""
        steps = self._async.lookups.find_steps
        return self._in_caller(timeout, steps, token_ids, identity, last=last)

    def find_keys(
        self,
        page_keys: list[str],
        timeout: float | None = None,
        *,
        position: int | None = None,
        anchor_key: str | None = None,
        lease: bool = True,
    ) -> StoredPrefix | None:
        """``AsyncKVCacheClient.find_keys`` in the caller's thread, as ``find``.
        ``lease`` False: how many are stored, with no read lease taken (SGLang's
        ``batch_exists``, whose answer is not fetched from:
        ``PrefixLookup.find_joined_steps``)."""
        lookups = self._async.lookups
        joined, place = lookups.keyed_hashes(page_keys), lookups.keyed_place(position, anchor_key)
        steps = lookups.find_joined_steps
        return self._in_caller(timeout, steps, joined, place=place, lease=lease)

    def stored_keys(self, page_keys: list[str], timeout: float | None = None) -> list[bool] | None:
        """Per key of ``page_keys`` (a keyed layout's own page keys), whether its page is
        stored (a live replica of this rank's share), each on its own: one index round
        trip, no read lease (SGLang's side pools, whose pages some positions of a prompt
        hold: ``PrefixLookup.stored_each_steps``). None on an index fault."""
        if not page_keys:
            return []
        lookups = self._async.lookups
        joined = lookups.keyed_hashes(page_keys)
        present = self._in_caller(timeout, lookups.stored_each_steps, joined)
        return None if present is None else present.tolist()

    def _in_caller(
        self,
        timeout: float | None,
        steps: Callable[Concatenate[LookupMethods, P], Steps[T | None] | Ready[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T | None:
        """The lookup ``steps(index, *args, **kwargs)`` (``PrefixLookup``'s steps) in the
        caller's thread (``PrefixLookup.blocking``, over the caller's index connection:
        ``find`` says why), or through the client's loop (``PrefixLookup.on_loop``,
        within ``timeout``: a miss past it) until the namespace is registered. Either
        way the same steps: only the edge that drives them differs."""
        lookups = self._async.lookups
        if not self._async.namespace_registered:
            coro = lookups.on_loop(steps, *args, **kwargs)
            return cast("T | None", self._read(coro, None, timeout))
        return lookups.blocking(self._index(timeout), steps, *args, **kwargs)

    def _index(self, timeout: float | None) -> PageIndex:
        """The caller's index connection whose reads wait at most ``timeout`` (the
        client's index timeout when None): one per distinct timeout (the vLLM
        scheduler's budget is one)."""
        seconds = min(self._async.timeout, INDEX_TIMEOUT) if timeout is None else timeout
        index = self._indexes.get(seconds)
        if index is None:
            with self._index_lock:  # one per timeout, however many threads ask at once
                index = self._indexes.get(seconds)
                if index is None:
                    opts = self._async.options
                    index = PageIndex(
                        opts.redis_url,
                        timeout=seconds,
                        lease_ms=opts.lease_ms,
                        password=opts.redis_password.get_secret_value() or None,
                        held_connections=True,  # asked after pauses: no pool on the way
                    )
                    self._indexes[seconds] = index
        return index

    # The puts: each a view of one plan (client.puts.plan), put by ``put``.
    put_pages = blocking_put_view(pages_put_plan)
    put_keyed = blocking_put_view(keyed_put_plan)

    def put(self, plan: PutPlan) -> PublishReport:
        """``AsyncKVCacheClient.put`` within the call's bound (past it: ``TransportError``)."""
        return cast(PublishReport, self._run(self._async.put(plan), self._bound()))

    # The gets: each a view of one plan (client.gets.plan), read by ``read``.
    get_pages = blocking_view(pages_plan)
    get_found = blocking_view(found_plan)
    get_found_device = blocking_view(device_plan)
    get_found_units = blocking_view(units_plan)
    get_found_into = blocking_view(spans_plan)

    def read(self, plan: GetPlan[R]) -> R:
        """``AsyncKVCacheClient.read``; a fault or the deadline gives the destination's
        ``miss`` (0 for most; ``(None, 0)`` for head-group units)."""
        return cast(R, self._read(self._async.read(plan), plan.into.miss))

    def lands_on_device(self, memory: torch.device) -> bool:
        """``AsyncKVCacheClient.lands_on_device`` (any thread)."""
        return self._async.lands_on_device(memory)

    def lands_layers(self, memory: torch.device) -> bool:
        """``AsyncKVCacheClient.lands_layers`` (any thread)."""
        return self._async.lands_layers(memory)

    @property
    def heads(self) -> RankUnits:
        """The head-group units this rank reads and writes (``kvstore.pages.heads``)."""
        return self._async.heads

    def units_nbytes(self, blocks: int) -> int:
        return self._async.units_nbytes(blocks)

    def insert(
        self,
        input_tokens: Any,
        roi: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        identity: Identity = None,
    ) -> PublishReport:
        return self._run(
            self._async.insert(input_tokens, roi, key, value, hidden, identity=identity),
            self._bound(),
        )

    def select(self, input_tokens: Any, roi: Any, *, identity: Identity = None) -> list[Any]:
        return self._read(self._async.select(input_tokens, roi, identity=identity), [None] * 5)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for index in self._indexes.values():
                index.close()
            self._run(self._async.close(), _MARGIN)

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
