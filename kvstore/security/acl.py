"""Redis/Valkey ACL rules for the three roles that use the index (docs/security.md).

- ``node``: storage nodes. Every key of the store (``kvs:*``): the registry (register,
  heartbeat, node numbers), every tenant's segments (commit, evict), namespace records.
- ``client``: engines and ``KVCacheClient`` of one tenant. Their tenant's keys
  (``kvs:t:<tenant>:*``: namespace records, lookups and their read leases) and a
  read-only view of the registry. They cannot register a node (the registry is where
  clients learn where to send pages and tokens), and cannot see or touch another
  tenant's keys.
- ``operator``: ``kvstore stats`` and dashboards: read-only, every key.

No role gets SCAN, KEYS or RANDOMKEY: measured on Valkey 9, key patterns do not filter
what those return, so they would list every tenant's page hashes. Scripts run with the
caller's rights (Valkey checks the keys each ``redis.call`` touches), so ``+evalsha``
grants nothing the key patterns do not; read-only callers use EVALSHA_RO.

``rules(role, tenant)`` is used by ``kvstore acl``, the Helm chart's template mirrors it
(templates/_helpers.tpl ``kvstore.aclRules``; tests/deploy/test_helm.py holds them equal) and
tests/kvstore/security/test_security.py runs every role against a real Valkey."""

from __future__ import annotations

import hashlib
import re

from kvstore.errors import InvalidInputError
from kvstore.pages import keys
from kvstore.pages.namespace import check_tenant

ROLES = ("node", "client", "operator")
# What every role runs: connection upkeep, the cluster's slot map, loading the scripts
# after a restart or failover, read-only scripts.
_COMMON = [
    "resetchannels",
    "-@all",
    "+ping",
    "+time",
    "+client|setinfo",
    "+cluster|slots",
    "+script|load",
    "+evalsha_ro",
]
# What the scripts call (kvstore/index/lua): live_nodes reads; lookup and lease renew leases.
_READ_SCRIPTS = ["+zrangebyscore", "+hgetall"]
# Lookups: the scripts, and plain reads (GET and PTTL of one segment; MGET of one-page
# segments asked with no lease, kvstore/index/lookups.py).
_LOOKUP = ["+evalsha", "+get", "+mget", "+set", "+pttl", "+pexpire"]
_REGISTRY = keys.REGISTRY_PREFIX + "*"


def rules(role: str, tenant: str | None = None) -> str:
    """The ACL rules (after ``ACL SETUSER <name> on >password``) for ``role``; a
    ``client`` names its ``tenant``."""
    if role not in ROLES:
        raise InvalidInputError(f"unknown index role {role!r}; expected one of {list(ROLES)}")
    if (role == "client") != (tenant is not None):
        raise InvalidInputError(
            "a client role names one --tenant; node and operator roles name none"
        )
    if role == "node":
        parts = [
            "resetkeys",
            "~kvs:*",
            *_COMMON,
            *_READ_SCRIPTS,
            *_LOOKUP,
            "+hsetnx",
            "+hget",
            "+hset",
            "+sadd",
            "+smembers",
            "+del",
            "+incr",
            "+zadd",
            "+zrem",
            "+zremrangebyscore",
            "+info",
        ]
    elif role == "client":
        assert tenant is not None
        check_tenant(tenant)
        parts = [
            "resetkeys",
            f"~{keys.tenant_keys(tenant)}",
            f"%R~{_REGISTRY}",
            *_COMMON,
            *_READ_SCRIPTS,
            *_LOOKUP,
            "+hsetnx",
        ]
    else:
        parts = ["resetkeys", "%R~kvs:*", *_COMMON, *_READ_SCRIPTS, "+smembers", "+hget"]
    return " ".join(parts)


def aclfile_line(user: str, role: str, tenant: str | None, password: str) -> str:
    """A line for a Valkey ``aclfile``: the user, on, its password as a SHA-256 (the
    file never holds the password), and the role's rules."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$", user):
        raise InvalidInputError(f"user name {user!r} must be 1-64 letters, digits or _.@-")
    if not password:
        raise InvalidInputError(f"user {user}: the password is empty")
    return f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} {rules(role, tenant)}"
