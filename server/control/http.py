"""The control API's requests on the node's HTTP threads (server/health.py serves the
port): each is parsed (kvstore.control.requests), authorised as a write of its tenant,
resolved to page keys through the index's namespace registry (as the prefix query
resolves a model, server/query.py), and handed to ``NodeControl`` on the event loop.

Any other path goes on to the prefix query API, so the node has one POST handler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from kvstore.control.requests import (
    ClearRequest,
    NodeAction,
    PinRequest,
    PrefixRequest,
    Scope,
)
from kvstore.errors import KVStoreError
from kvstore.pages.identity import RequestIdentity
from kvstore.pages.namespace import Namespace
from server.control.ops import NodeControl
from server.control.pins import PinRefused
from server.page import PageKey, StoredPage
from server.prefix_keys import block_keys, prefix_chain
from server.query import PrefixQuery, QueryRefused

# longest the HTTP thread waits for the loop's answer (a prefetch reads from disk)
ANSWER_TIMEOUT_S = 60.0


class ControlAPI:
    """Answers ``POST /v1/kv/pin|unpin|prefetch|clear`` and hands the rest to the query."""

    def __init__(
        self, query: PrefixQuery, control: NodeControl, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.query = query
        self.control = control
        self.loop = loop
        self._routes: dict[str, tuple[type[Scope], Callable[[Any], Coroutine[Any, Any, Any]]]] = {
            "/v1/kv/pin": (PinRequest, self._pin),
            "/v1/kv/unpin": (PrefixRequest, self._unpin),
            "/v1/kv/prefetch": (PrefixRequest, self._prefetch),
            "/v1/kv/clear": (ClearRequest, self._clear),
        }

    def handle(
        self, target: str, body: bytes, authorization: str, content_type: str = ""
    ) -> tuple[int, bytes]:
        """(HTTP status, JSON body) for a POST to ``target``."""
        route = self._routes.get(target.partition("?")[0])
        if route is None:
            return self.query.handle(target, body, authorization, content_type)
        model, action = route
        try:
            req = model.model_validate_json(body)
            self.query.authorize(authorization, req.tenant, write=True)
            answer: BaseModel = self._on_loop(action(req))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return 400, _error(f"invalid request: {where}: {first['msg']}".replace(": : ", ": "))
        except ValueError as exc:
            return 400, _error(f"invalid request: {exc}")
        except QueryRefused as exc:
            return exc.status, _error(str(exc))
        except PinRefused as exc:
            return 409, _error(str(exc))
        except KVStoreError as exc:
            return 503, _error(f"the index could not answer: {exc}")
        except TimeoutError:
            return 503, _error(f"the node did not finish within {ANSWER_TIMEOUT_S:.0f} s")
        return 200, answer.model_dump_json().encode()

    def _on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(ANSWER_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None

    # ---- the four actions (coroutines on the loop; the keys are resolved first) ----------

    async def _pin(self, req: PinRequest) -> NodeAction:
        return await self.control.pin(await self._blocks(req), req.ttl_s)

    async def _unpin(self, req: PrefixRequest) -> NodeAction:
        return await self.control.unpin(await self._blocks(req))

    async def _prefetch(self, req: PrefixRequest) -> NodeAction:
        return await self.control.prefetch(await self._blocks(req))

    async def _clear(self, req: ClearRequest) -> NodeAction:
        if req.has_prefix:
            keys = {k for block in await self._blocks(req) for k in block}
            return await self.control.clear(lambda p: p.key in keys, "prefix")
        tenant = req.tenant
        if req.namespace is None and req.model is None:
            return await self.control.clear(lambda p: p.owner == tenant, "tenant")
        digests = {ns.digest_hex for ns in await self._namespaces(req)}

        def chosen(page: StoredPage) -> bool:
            return page.owner == tenant and page.key[0] in digests

        return await self.control.clear(chosen, "model" if req.namespace is None else "namespace")

    async def _namespaces(self, req: Scope) -> list[Namespace]:
        """The namespaces ``req`` names (the registry read off the loop: it blocks)."""
        refresh = req.namespace is not None
        spaces = await asyncio.to_thread(self.query.namespaces, req.model, req.tenant, refresh)
        return [
            ns
            for ns in spaces
            if (req.namespace is None or ns.digest_hex == req.namespace)
            and (req.block_size is None or ns.block_size == req.block_size)
        ]

    async def _blocks(self, req: Scope) -> list[list[PageKey]]:
        """The page keys of each block of the prefix ``req`` names, in every namespace it
        names (blocks of several namespaces follow one another)."""
        if req.block_hashes is not None:
            joined = b"".join(bytes.fromhex(h) for h in req.block_hashes)
            return [b for ns in await self._namespaces(req) for b in block_keys(ns, joined)]
        assert req.token_ids is not None
        tokens = np.asarray(req.token_ids, dtype="<u4")
        identity = RequestIdentity(adapter=req.lora_name, cache_salt=req.cache_salt)
        return [
            b
            for ns in await self._namespaces(req)
            for b in block_keys(ns, prefix_chain(ns, tokens, identity))
        ]


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
