"""Who may read a publisher's events, and which of them: CURVE keys checked by a ZAP
handler, and per-tenant topic prefixes granted per router.

Built by a storage node whose event stream is authenticated, and handed to its
``EventPublisher`` (``kvstore.events.publisher``), which asks it:

- ``admits(key)`` for each connection's CURVE key during the handshake (ZAP);
- ``grants(key, prefix)`` for each subscription a connected router sends: the topic
  prefixes it is subscribed to instead. A router that reads every tenant gets the
  prefix it asked for; one that reads some tenants gets, for each of them, the longer
  of its prefix and the tenant's (``kv@pool:<store>:<tenant>@``) where one extends the
  other - exactly the topics both the router asked for and may read. A subscription to
  everything (``""``) is thus a subscription to each of its tenants' topics, which is
  what vLLM's subscribers and llm-d send;
- ``reads(key, topic)`` for each batch a replay would send.

Topics that name no tenant (a page recovered from disk whose namespace the node has not
learnt) reach only routers that read every tenant. The keys are the routers file's
(``kvstore.security.routers``), re-read when it changes; ``generation`` grows when a
reload takes a right away, so the publisher can drop existing connections (ZAP runs
only at a handshake, and a subscription granted stays granted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvstore.security.routers import RouterKey, load_key_pair
from kvstore.security.watched import WatchedTable


@dataclass(frozen=True)
class CurveKeys:
    """The publisher's own CURVE key pair (Z85)."""

    public: bytes
    secret: bytes


class EventAccess:
    """Routers' rights over a publisher's topics; see the module doc. Called from the
    publisher's thread only (the ZAP handler runs there too)."""

    def __init__(
        self,
        keys: CurveKeys,
        routers: WatchedTable[RouterKey],
        tenant_prefix: Callable[[str], str],
    ) -> None:
        self.keys = keys
        self._routers = routers
        self._tenant_prefix = tenant_prefix
        self._seen = routers.table()
        self._generation = 0

    def admits(self, key: str) -> bool:
        """True when ``key`` (a connecting router's public key, Z85) is listed. An
        unlisted key makes the routers file be read at once: a ZeroMQ client refused at
        the handshake does not retry, so a router added a moment ago must not be."""
        return key in self._table() or key in self._table(fresh=True)

    def grants(self, key: str | None, prefix: bytes) -> list[bytes]:
        """The prefixes a subscription to ``prefix`` from ``key`` becomes (none: the
        router may read no topic it asked for)."""
        router = self._table().get(key or "")
        if router is None:
            return []
        if router.tenants is None:
            return [prefix]
        out = []
        for tenant in sorted(router.tenants):
            mine = self._tenant_prefix(tenant).encode()
            if mine.startswith(prefix):
                out.append(mine)
            elif prefix.startswith(mine):
                out.append(prefix)
        return out

    def reads(self, key: str | None, topic: bytes) -> bool:
        """True when ``key``'s router may read a batch published under ``topic``."""
        router = self._table().get(key or "")
        if router is None:
            return False
        if router.tenants is None:
            return True
        return any(topic.startswith(self._tenant_prefix(t).encode()) for t in router.tenants)

    def generation(self) -> int:
        """A number that grows each time a reload of the routers file removed a key or
        narrowed a router's tenants (connections made before then must handshake again)."""
        self._table()
        return self._generation

    def _table(self, fresh: bool = False) -> dict[str, RouterKey]:
        table = self._routers.table(fresh=fresh)
        if table is not self._seen:
            if any(not _covers(table.get(k), old) for k, old in self._seen.items()):
                self._generation += 1
            self._seen = table
        return table


def _covers(new: RouterKey | None, old: RouterKey) -> bool:
    """True when ``new`` grants at least what ``old`` did."""
    if new is None:
        return False
    if new.tenants is None:
        return True
    return old.tenants is not None and old.tenants <= new.tenants


def curve_client(sock: zmq.Socket, node_public_key: str, key_file: str) -> None:
    """Make ``sock`` (a router's SUB, DEALER or REQ, before it connects) authenticate to
    a node whose public key is ``node_public_key`` (Z85, what ``kvstore events-key
    node`` printed) with the router's key pair in ``key_file`` (its ``.key_secret``).
    For routers and relays written in Python; other ZeroMQ bindings set the same three
    CURVE options."""
    public, secret = load_key_pair(key_file, "router key file")
    sock.curve_serverkey = node_public_key.encode("ascii")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
