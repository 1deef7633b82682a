"""The registry in the index: which storage nodes are alive (registration, heartbeats,
fencing) and which namespaces are stored (their records and the stats over them).

Nodes register and heartbeat; clients and operators read live nodes, namespaces and
stats. Keys as in ``kvstore.pages.keys``; the scripts are register.lua, deregister.lua
and live_nodes.lua."""

from __future__ import annotations

import secrets
from typing import Any

from kvstore.errors import FencedError, InvalidInputError, NodeIdInUseError
from kvstore.index import checks, scripts
from kvstore.index.commands import Cmd
from kvstore.index.driver import IndexDriver, Steps, driven, raise_first, single, text
from kvstore.index.records import IndexStats, NamespaceStats, NodeInfo, Registration
from kvstore.pages import keys
from kvstore.pages.namespace import Namespace


def live_nodes_cmd() -> Cmd:
    """The read of live nodes (live_nodes.lua), parsed into ``NodeInfo``; a lookup
    ``lookup_with_nodes`` sends it in its own batch."""

    def parse(raw: list) -> list[NodeInfo]:
        nodes, pos = [], 0
        while pos < len(raw):
            node_id, pos = text(raw[pos]), pos + 1
            fields: dict[str, str] = {}
            while text(raw[pos]) != "":
                fields[text(raw[pos])] = text(raw[pos + 1])
                pos += 2
            pos += 1
            address, capacity, inc, number = (
                fields.pop("address"),
                fields.pop("capacity"),
                fields.pop("inc"),
                fields.pop("no", "0"),
            )
            nodes.append(NodeInfo(node_id, address, int(capacity), inc, int(number), fields))
        return nodes

    return Cmd.run_script(
        scripts.LIVE_NODES,
        [keys.NODES_ZSET],
        [keys.REGISTRY_PREFIX + "node:"],
        parse,
        readonly=True,
    )


class RegistryMethods(IndexDriver):
    """Keeps the registry (its one job): storage nodes' incarnations and numbers, the
    live nodes, the namespaces stored and the pages each node reports of them."""

    def _register_node(
        self,
        node_id: str,
        address: str,
        capacity: int,
        ttl_ms: int,
        incarnation: str | None = None,
        *,
        replaces: str = "",
        extra: dict[str, str] | None = None,
    ) -> Steps[Registration]:
        """Register a new incarnation (``incarnation=None``; ``replaces`` names the
        caller's own previous one) or heartbeat ``incarnation``; returns a
        ``Registration``. Raises ``NodeIdInUseError`` when another live incarnation holds
        the node id and ``FencedError`` when a heartbeat's incarnation is no longer the
        registered one."""
        if not node_id or "|" in node_id:
            raise InvalidInputError(f"node id {node_id!r} must be non-empty and contain no '|'")
        fields = {"address": address, "capacity": str(capacity), **(extra or {})}
        # The script mints a new incarnation from its clock and these random bits, so it
        # never repeats, not even after the index lost every key (a counter would).
        args: list[Any] = [
            node_id,
            "" if incarnation is None else checks.incarnation(incarnation),
            ttl_ms,
            secrets.token_hex(8),
            replaces,
        ]
        for k, v in fields.items():
            args += [k, v]
        key_list = [
            keys.NODES_ZSET,
            keys.node_key(node_id),
            keys.incarnation_key(node_id),
            keys.NODE_NUMBERS,
            keys.NODE_NUMBER_COUNTER,
        ]

        def parse(raw: list) -> Registration:
            if int(raw[0]) == 1:
                return Registration(text(raw[1]), int(raw[2]))
            if text(raw[1]) == "in_use":
                raise NodeIdInUseError(
                    f"node id {node_id!r} is in use by a live node at {text(raw[2])}; give every node its own --node-id"
                )
            raise FencedError(
                f"incarnation {incarnation} of node {node_id!r} is no longer the registered one"
            )

        return single(Cmd.run_script(scripts.REGISTER, key_list, args, parse))

    register_node = driven(_register_node)

    def _deregister_node(self, node_id: str, incarnation: str) -> Steps[bool]:
        """Remove the node from the registry if ``incarnation`` is still its current one
        (a node that stops); True when it was."""
        key_list = [keys.NODES_ZSET, keys.node_key(node_id)]
        return single(
            Cmd.run_script(
                scripts.DEREGISTER, key_list, [node_id, checks.incarnation(incarnation)], bool
            )
        )

    deregister_node = driven(_deregister_node)

    def _live_nodes(self) -> Steps[list[NodeInfo]]:
        """The nodes whose heartbeat deadline has not passed, as ``NodeInfo``."""
        return single(live_nodes_cmd())

    live_nodes = driven(_live_nodes)

    def _ensure_namespace(self, namespace: Namespace) -> Steps[int]:
        """Record the namespace under its tenant's keys (idempotent): clients at start,
        nodes after an index loss."""
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(
                f"ensure_namespace needs a Namespace, got {type(namespace).__name__}"
            )
        meta = namespace.key.meta
        return single(Cmd(("HSETNX", meta, "json", namespace.canonical_json()), key=meta))

    ensure_namespace = driven(_ensure_namespace)

    def _announce_namespace(self, key: keys.NamespaceKey) -> Steps[int]:
        """List a namespace in the registry, for ``stats`` (nodes, when they first
        serve it: clients cannot write the registry)."""
        return single(
            Cmd(
                ("SADD", keys.NAMESPACES_SET, checks.namespace_key(key).member),
                key=keys.NAMESPACES_SET,
            )
        )

    announce_namespace = driven(_announce_namespace)

    def _namespace(self, key: keys.NamespaceKey) -> Steps[Namespace | None]:
        """The registered ``Namespace`` at ``key``, or None (nodes learn namespaces here;
        the caller checks that it hashes to the digest)."""
        meta = checks.namespace_key(key).meta

        def steps() -> Steps[Namespace | None]:
            raw = raise_first((yield [Cmd(("HGET", meta, "json"), key=meta)]))[0]
            return Namespace.model_validate_json(raw) if raw else None

        return steps()

    namespace = driven(_namespace)

    def _stats(self) -> Steps[IndexStats]:
        """Live nodes and, per namespace, the pages their current incarnations report."""

        def steps() -> Steps[IndexStats]:
            nodes, members = raise_first(
                (
                    yield [
                        live_nodes_cmd(),
                        Cmd(("SMEMBERS", keys.NAMESPACES_SET), key=keys.NAMESPACES_SET),
                    ]
                )
            )
            spaces_keys = sorted(
                (keys.NamespaceKey.from_member(text(m)) for m in members), key=lambda k: k.member
            )
            metas = (
                raise_first(
                    (yield [Cmd(("HGET", k.meta, "json"), key=k.meta) for k in spaces_keys])
                )
                if spaces_keys
                else []
            )
            spaces = []
            for key, raw in zip(spaces_keys, metas):
                digest = key.digest
                per_node = {n.node_id: n.pages[digest] for n in nodes if n.pages.get(digest)}
                ns = Namespace.model_validate_json(raw) if raw else None
                spaces.append(NamespaceStats(digest, sum(per_node.values()), ns, per_node))
            return IndexStats(nodes, spaces)

        return steps()

    stats = driven(_stats)
