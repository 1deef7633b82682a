"""The one line each side of the connector logs at start: what it reached (the index,
the live nodes), the tenant, where its token came from and the namespace id; a WARNING
when the engine will run without the store. Called by ``client.vllm.options.rank_client``."""

from __future__ import annotations

import os

from client.sync_client import KVCacheClient
from kvstore.index.routing import redact_url
from kvstore.settings.client import ClientOptions


def token_source(options: ClientOptions) -> str:
    """Where the connector's data-plane token came from, for its start line."""
    if options.auth_token_file:
        where = (
            "KVSTORE_AUTH_TOKEN_FILE"
            if os.environ.get("KVSTORE_AUTH_TOKEN_FILE") == options.auth_token_file
            else "kv_connector_extra_config"
        )
        return f"{where} ({options.auth_token_file})"
    if options.auth_token.get_secret_value():
        return (
            "KVSTORE_AUTH_TOKEN"
            if os.environ.get("KVSTORE_AUTH_TOKEN") == options.auth_token.get_secret_value()
            else "kv_connector_extra_config"
        )
    return "nowhere (nodes must run --anonymous)"


def start_line(client: KVCacheClient, options: ClientOptions) -> tuple[str, bool]:
    """One line of what the connector reached at start: the index, the live nodes,
    the tenant, where the token came from, and the namespace (the id ``kvstore stats``
    lists, the same on every side and rank of an engine); and whether all is well (else
    the line is a WARNING: an unreachable index, a refused token or no live node leave
    the engine running without the store)."""
    ns = client.namespace
    status = client.start_status()
    index = f"index {redact_url(options.redis_url)} " + (
        "reached"
        if status.index_reached
        else f"NOT reached ({status.index_error}): every lookup is a miss until it is"
    )
    refused = (
        f" REFUSED by {', '.join(sorted(status.refused))}"
        f" ({next(iter(status.refused.values()))}): saves and loads will fail"
        if status.refused
        else ""
    )
    nodes = (
        f" ({', '.join(status.nodes)})"
        if status.nodes
        else ": saves and loads fail until one registers"
        if status.index_reached
        else ""
    )
    line = (
        f"{index}, {len(status.nodes)} live node(s){nodes}, tenant {ns.tenant}, "
        f"token from {token_source(options)}{refused}, namespace {ns.storage.digest_hex} "
        f"({ns.model} {ns.dtype} {ns.layout}, weights {ns.weights or '-'})"
    )
    return line, status.index_reached and bool(status.nodes) and not status.refused
