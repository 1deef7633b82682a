"""A client's operator control calls: pin, unpin, prefetch, clear and "where" of its own
prefixes, on every live node (docs/operations.md, "Steering the cache").

The client hashes the tokens itself, as its puts do (``chain_hashes``, under the
request's identity), and names them in the hash form of ``kvstore.control.requests``:
its storage namespace's digest (the node's page keys carry it), its tenant, and the
block hashes. The nodes come from the client's node directory, the token is its
``auth_token``; ``kvstore.control.caller`` sends each request to every live node and
adds up the answers (a node acts only on the pages it holds).

``AsyncControlCalls`` and ``ControlCalls`` are the calls as methods of
``AsyncKVCacheClient`` and ``KVCacheClient`` (mixins: written here once, so the
clients keep one line each)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from client.lookups.prefix import Identity
from client.nodes.directory import NodeDirectory
from kvstore.control.caller import CONNECT_TIMEOUT, CONTROL_TIMEOUT, ControlCaller
from kvstore.control.reports import ControlReport, WhereReport
from kvstore.control.requests import ClearRequest, PinRequest, PrefixRequest, Scope
from kvstore.errors import InvalidInputError, first_problem
from kvstore.pages.hashing import split_hashes
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import ClientOptions

S = TypeVar("S", bound=Scope)
# what a blocking control call waits for past the caller's own timeout (threads, the loop)
_MARGIN_S = 5.0


class ClientControl:
    """One job: a client's prefixes as control requests, sent to every live node. Built
    by ``AsyncKVCacheClient``; ``call`` and ``where`` run on the client's loop (the
    blocking fan-out in a worker thread), the rest anywhere."""

    def __init__(
        self,
        storage: Namespace,
        chain_hashes: Callable[[Any, Identity], bytes],
        nodes: NodeDirectory,
        options: ClientOptions,
    ) -> None:
        self._storage = storage
        self._chain_hashes = chain_hashes
        self._nodes = nodes
        # not the client's data-path timeout: a pin or prefetch reads a node's disk first
        token = options.auth_token.get_secret_value()
        self._caller = ControlCaller(nodes.last, token, CONTROL_TIMEOUT)
        # the longest a blocking client waits for one call: a node's connect and answer
        self.bound = CONNECT_TIMEOUT + CONTROL_TIMEOUT + _MARGIN_S

    def prefix(self, kind: type[S], token_ids: Any, identity: Identity, **fields: Any) -> S:
        """A ``kind`` body naming ``token_ids``' full blocks (under ``identity``) in
        this client's namespace and tenant; ``InvalidInputError`` when they hold no
        full block, or a field is out of range (naming it)."""
        hashes = split_hashes(self._chain_hashes(token_ids, identity))
        if not hashes:
            raise InvalidInputError(
                f"token_ids hold no full block of {self._storage.block_size} tokens"
            )
        return self.body(kind, block_hashes=[h.hex() for h in hashes], **fields)

    def clear_scope(self, token_ids: Any, identity: Identity, tenant_wide: bool) -> ClearRequest:
        """What ``clear`` names: ``token_ids``' prefix in this client's namespace; the
        whole namespace without them; every page of the tenant with ``tenant_wide``."""
        if tenant_wide:
            if token_ids is not None:
                raise InvalidInputError("clear takes token_ids or tenant_wide=True, not both")
            return self.body(ClearRequest, namespace=None)
        if token_ids is None:
            return self.body(ClearRequest)
        return self.prefix(ClearRequest, token_ids, identity)

    def body(self, kind: type[S], **fields: Any) -> S:
        """A ``kind`` body of this client's tenant and namespace (``namespace=None``
        leaves the namespace out), ``fields`` added; a field out of range raises
        ``InvalidInputError`` naming it."""
        named = {"tenant": self._storage.tenant, "namespace": self._storage.digest_hex, **fields}
        try:
            return kind(**named)
        except ValidationError as exc:
            where, _, message = first_problem(exc)
            raise InvalidInputError(f"{where}: {message}" if where else message) from None

    async def call(self, path: str, body: Scope) -> ControlReport:
        """``ControlCaller.call`` of every registered node (the registry read first when
        the client's list went stale), in a worker thread: the loop goes on meanwhile."""
        await self._nodes.current()
        return await asyncio.to_thread(self._caller.call, path, body)

    async def where(self, body: PrefixRequest) -> WhereReport:
        """``ControlCaller.where`` of every registered node, as ``call``."""
        await self._nodes.current()
        return await asyncio.to_thread(self._caller.where, body)


class AsyncControlCalls:
    """The control calls of ``AsyncKVCacheClient`` (a mixin: ``control`` is the
    client's ``ClientControl``). Each acts on every live node holding the pages;
    ``ControlReport.unreachable`` names the nodes it could not reach. A token the
    nodes refuse raises ``CredentialError``, a bad argument ``InvalidInputError``."""

    control: ClientControl

    async def pin(
        self, token_ids: Any, *, identity: Identity = None, ttl_s: float | None = None
    ) -> ControlReport:
        """Keep the stored pages of ``token_ids``' full blocks in memory (brought back
        from disk first) on every node holding them, for ``ttl_s`` seconds or, when
        None, until ``unpin``; pinning again replaces the TTL. A node whose limits
        refuse (its pin share of memory, the tenant's quota) raises
        ``PinRefusedError`` once all answered: the other nodes' pins stand."""
        body = self.control.prefix(PinRequest, token_ids, identity, ttl_s=ttl_s)
        return await self.control.call("/v1/kv/pin", body)

    async def unpin(self, token_ids: Any, *, identity: Identity = None) -> ControlReport:
        """Release the pins of ``token_ids``' pages: they are evicted as any others."""
        body = self.control.prefix(PrefixRequest, token_ids, identity)
        return await self.control.call("/v1/kv/unpin", body)

    async def prefetch(self, token_ids: Any, *, identity: Identity = None) -> ControlReport:
        """Bring ``token_ids``' pages that are only on a node's disk back into its
        memory (not pinned: evicted as any others later)."""
        body = self.control.prefix(PrefixRequest, token_ids, identity)
        return await self.control.call("/v1/kv/prefetch", body)

    async def clear(
        self, token_ids: Any = None, *, identity: Identity = None, tenant_wide: bool = False
    ) -> ControlReport:
        """Drop pages from every node: ``token_ids``' prefix in this client's
        namespace; without them, the whole namespace; with ``tenant_wide``, every page
        of the client's tenant (every model). Later lookups miss at once; a reader that
        looked up before finishes (the nodes' clear grace)."""
        body = self.control.clear_scope(token_ids, identity, tenant_wide)
        return await self.control.call("/v1/kv/clear", body)

    async def where(self, token_ids: Any, *, identity: Identity = None) -> WhereReport:
        """Which nodes hold which of ``token_ids``' blocks, in memory or on disk,
        pinned or not (``WhereReport.holders``, ``.summary``)."""
        return await self.control.where(self.control.prefix(PrefixRequest, token_ids, identity))


class ControlCalls:
    """The control calls of ``KVCacheClient`` (a mixin): ``AsyncControlCalls``' calls
    of the client's ``AsyncKVCacheClient``, each run on the client's loop and waited
    for at most ``ClientControl.bound`` (past it ``TransportError``)."""

    _async: Any  # the client's AsyncKVCacheClient

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError  # KVCacheClient's

    def _control(self, coro: Any) -> Any:
        return self._run(coro, self._async.control.bound)

    def pin(
        self, token_ids: Any, *, identity: Identity = None, ttl_s: float | None = None
    ) -> ControlReport:
        """``AsyncKVCacheClient.pin``."""
        return self._control(self._async.pin(token_ids, identity=identity, ttl_s=ttl_s))

    def unpin(self, token_ids: Any, *, identity: Identity = None) -> ControlReport:
        """``AsyncKVCacheClient.unpin``."""
        return self._control(self._async.unpin(token_ids, identity=identity))

    def prefetch(self, token_ids: Any, *, identity: Identity = None) -> ControlReport:
        """``AsyncKVCacheClient.prefetch``."""
        return self._control(self._async.prefetch(token_ids, identity=identity))

    def clear(
        self, token_ids: Any = None, *, identity: Identity = None, tenant_wide: bool = False
    ) -> ControlReport:
        """``AsyncKVCacheClient.clear``."""
        coro = self._async.clear(token_ids, identity=identity, tenant_wide=tenant_wide)
        return self._control(coro)

    def where(self, token_ids: Any, *, identity: Identity = None) -> WhereReport:
        """``AsyncKVCacheClient.where``."""
        return self._control(self._async.where(token_ids, identity=identity))
