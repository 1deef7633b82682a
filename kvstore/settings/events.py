"""A storage node's KV-event options (``--kv-events-*``), and the rule that keeps a
node checking tokens from handing every tenant's blocks to anyone who connects.

``ServerSettings`` inherits these fields and calls ``check_event_settings`` from its
own validator, so ``kvstore server --help`` lists them with the rest."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field

from kvstore.errors import InvalidInputError
from kvstore.security.credentials import parse_tenants

# the routers a node's or the connector's events can be shaped for (kvstore.events.profiles)
EventProfileName = Literal["vllm", "dynamo"]


class EventSettings(BaseModel):
    """The ``kv_events_*`` fields of ``ServerSettings`` (docs/router-integration.md,
    docs/security.md)."""

    kv_events_endpoint: str | None = Field(
        None,
        description=(
            "ZMQ PUB address of this node's vLLM-format KV events, e.g. tcp://*:5557 (binds) "
            "or tcp://router:5557 (connects); None: no events (docs/router-integration.md)"
        ),
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description=(
            "ZMQ ROUTER address (bound) replaying recent event batches to a router that "
            "restarted, e.g. tcp://*:5558"
        ),
    )
    kv_events_store_id: str | None = Field(
        None,
        pattern=r"^[^@]+$",
        description=(
            "<store id> of the event topics kv@pool:<store id>:<tenant>@<model> (default: the "
            "node id, so removals and AllBlocksCleared name only this node's blocks)"
        ),
    )
    kv_events_queue: int = Field(
        100_000,
        ge=1,
        description="block events waiting to be sent, past which they are dropped (kvstore_events_dropped_total)",
    )
    kv_events_routers_file: str | None = Field(
        None,
        description=(
            "routers allowed to subscribe, one per line: name, CURVE public key, tenants it "
            "reads (kvstore events-key router); re-read when it changes. Turns on CURVE "
            "authentication and per-tenant topics (docs/security.md)"
        ),
    )
    kv_events_key_file: str | None = Field(
        None,
        description=(
            "this node's CURVE secret key (a ZeroMQ certificate, kvstore events-key node); "
            "needed with --kv-events-routers-file"
        ),
    )
    kv_events_profile: EventProfileName = Field(
        "vllm",
        description=(
            "the routers the events are shaped for: vllm (16-byte block hashes, ownership "
            "kvstore; vLLM's decoder, llm-d) or dynamo (64-bit integer block hashes, no "
            "ownership: what NVIDIA Dynamo's KV indexer takes; llm-d reads it too)"
        ),
    )
    kv_events_token_ids: str | None = Field(
        None,
        description=(
            "tenants whose blocks are announced with their token ids, comma-separated, * for "
            "all, empty for none; others' blocks carry block hashes only (default: * on an "
            "--anonymous node, none on a node that checks tokens)"
        ),
    )
    kv_events_open: bool = Field(
        False,
        description=(
            "let a node that checks tokens publish events unauthenticated on a non-loopback "
            "address: anyone who reaches it reads every tenant's blocks (off: such a node "
            "needs --kv-events-routers-file, or a loopback address)"
        ),
    )


def check_event_settings(s: EventSettings, *, checks_tokens: bool) -> None:
    """Raise ``ValueError`` naming the options when ``s`` is inconsistent, or when a
    node that checks tokens would publish its tenants' blocks to anyone on the network.
    Called by ``ServerSettings``' validator."""
    if s.kv_events_routers_file or s.kv_events_key_file:
        if not (s.kv_events_routers_file and s.kv_events_key_file):
            raise ValueError(
                "--kv-events-routers-file and --kv-events-key-file go together: the routers' "
                "public keys and this node's own key (kvstore events-key)"
            )
        if not s.kv_events_endpoint:
            raise ValueError("--kv-events-routers-file needs --kv-events-endpoint")
        if not binds(s.kv_events_endpoint):
            raise ValueError(
                f"--kv-events-endpoint {s.kv_events_endpoint} connects to a router; with "
                "--kv-events-routers-file the node binds (tcp://*:PORT) and routers connect "
                "and authenticate"
            )
        if s.kv_events_open:
            raise ValueError("--kv-events-open contradicts --kv-events-routers-file")
        from kvstore.security.routers import load_key_pair, router_keys

        try:
            router_keys(s.kv_events_routers_file)
            load_key_pair(s.kv_events_key_file, "--kv-events-key-file")
        except InvalidInputError as exc:
            raise ValueError(str(exc)) from None
    if s.kv_events_token_ids:
        try:
            parse_tenants(s.kv_events_token_ids.split(","), "--kv-events-token-ids")
        except InvalidInputError as exc:
            raise ValueError(str(exc)) from None
    if not (s.kv_events_endpoint and checks_tokens) or s.kv_events_routers_file:
        return
    for endpoint in (s.kv_events_endpoint, s.kv_events_replay_endpoint):
        if endpoint and not local(endpoint) and not s.kv_events_open:
            raise ValueError(
                f"KV events on {endpoint} would give every tenant's blocks to anyone who "
                "reaches that address: give --kv-events-routers-file and --kv-events-key-file "
                "(routers authenticate and read only their tenants), a loopback address, or "
                "--kv-events-open to publish to anyone anyway"
            )


def token_tenants(s: EventSettings, *, checks_tokens: bool) -> frozenset[str] | None:
    """Tenants whose blocks are announced with token ids (None: every tenant)."""
    spec = s.kv_events_token_ids
    if spec is None:
        return frozenset() if checks_tokens else None
    if not spec.strip():
        return frozenset()
    return parse_tenants(spec.split(","), "--kv-events-token-ids")


def binds(endpoint: str) -> bool:
    """True when a PUB on ``endpoint`` binds under vLLM's rule (a wildcard, ipc://,
    inproc://); any other address connects."""
    return "*" in endpoint or "[::]" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_LOOPBACK = re.compile(r"^tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):\d+$")


def local(endpoint: str) -> bool:
    """True when only this host can reach ``endpoint`` (loopback, ipc://, inproc://)."""
    return endpoint.startswith(("ipc://", "inproc://")) or bool(_LOOPBACK.match(endpoint))
