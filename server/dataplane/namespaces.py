"""The namespaces a node serves, learnt from the index and kept."""

from __future__ import annotations

import logging

from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.keys import NamespaceKey
from kvstore.pages.namespace import Namespace
from kvstore.wire import protocol as P
from server.dataplane.errors import Refused

log = logging.getLogger(__name__)


class NamespaceCache:
    """The namespace behind each digest a request names, read from the index once and
    kept; the registry re-publishes them after an index loss (server/registry.py)."""

    def __init__(self, index: AsyncPageIndex) -> None:
        self.index = index
        self._known: dict[str, Namespace] = {}  # digest hex -> namespace

    def get(self, digest: str) -> Namespace | None:
        """The namespace of ``digest``, if a request of this node's brought it here."""
        return self._known.get(digest)

    async def lookup(self, req: P.PutRequest | P.GetRequest | P.SlotReads) -> Namespace:
        """The namespace behind a request's digest, read from the index once (under the
        tenant the request names) and cached. What the index holds must hash to the
        digest, so the tenant a node acts on is the one the digest names; then the node
        lists it in the registry (clients cannot)."""
        digest = req.namespace
        ns = self._known.get(digest)
        if ns is not None and ns.tenant != req.tenant:  # the same answer whether cached or not
            raise Refused(
                P.RefusalCode.UNKNOWN_NAMESPACE,
                f"namespace {digest} of tenant {req.tenant} is not registered in the index",
            )
        if ns is None:
            key = NamespaceKey(req.tenant, digest)
            try:
                ns = await self.index.namespace(key)
            except RemoteFault as exc:
                raise Refused(
                    P.RefusalCode.INDEX_UNAVAILABLE,
                    f"cannot read namespace {digest} from the index: {exc}",
                ) from exc
            if ns is None or ns.digest_hex != digest or ns.tenant != req.tenant:
                raise Refused(
                    P.RefusalCode.UNKNOWN_NAMESPACE,
                    f"namespace {digest} of tenant {req.tenant} is not registered in the index",
                )
            try:
                await self.index.announce_namespace(key)
            except (
                RemoteFault
            ) as exc:  # only `kvstore stats` misses it; announced again after an index loss
                log.warning("cannot list namespace %s in the registry: %s", key.member, exc)
            self._known[digest] = ns
        return ns
