"""Redis key names; the format is documented in docs/key-format.md.

Every key of one namespace carries the namespace digest as its hash tag, so a
namespace's pages, liveness mirror and metadata live in one Redis Cluster slot and
each Lua script touches a single slot. Node registry keys share the tag {registry}."""

REGISTRY_PREFIX = "kvs:{registry}:"
NODES_ZSET = REGISTRY_PREFIX + "nodes"
NAMESPACES_SET = REGISTRY_PREFIX + "namespaces"


def namespace_prefix(ns_hex: str) -> str:
    """Prefix of every key of one namespace: ``kvs:{<digest hex>}:``."""
    return f"kvs:{{{ns_hex}}}:"


def meta_key(ns_hex: str) -> str:
    return namespace_prefix(ns_hex) + "meta"


def alive_key(ns_hex: str) -> str:
    return namespace_prefix(ns_hex) + "alive"


def page_key(ns_hex: str, page_hash_hex: str) -> str:
    return namespace_prefix(ns_hex) + "p:" + page_hash_hex


def node_key(node_id: str) -> str:
    return REGISTRY_PREFIX + "node:" + node_id


def incarnation_key(node_id: str) -> str:
    """The node id's current incarnation (no TTL), so a stale one is fenced even after
    its registry entry expired."""
    return REGISTRY_PREFIX + "inc:" + node_id
