"""What a publisher is told (``PublisherOptions``, from a node's command line or
settings) and what it counts (``PublisherStats``); kvstore.events.publisher uses both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstore.settings.config import ByteSize


class PublisherOptions(BaseModel):
    """How a node publishes its events (from its command line or settings)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(
        description="PUB address, e.g. tcp://*:5557 (binds) or tcp://router:5557 (connects); see mode"
    )
    mode: Literal["auto", "bind", "connect"] = Field(
        "auto",
        description=(
            "auto: bind a wildcard (tcp://*:PORT, tcp://[::]:PORT), ipc:// or inproc:// address "
            "and connect to any other, as vLLM does"
        ),
    )
    replay_endpoint: str | None = Field(
        None, description="ROUTER address (always bound) serving missed batches; None: no replay"
    )
    topic: str = Field(
        "", description="first frame of every message (kvstore.events.pool_topic gives a node's)"
    )
    max_queue_events: int = Field(
        100_000, ge=1, description="events waiting to be sent, past which publish drops (counted)"
    )
    max_batch_events: int = Field(1024, ge=1, description="events per message at most")
    replay_batches: int = Field(10_000, ge=0, description="batches kept for replay")
    replay_bytes: ByteSize = Field(64 << 20, description="payload bytes kept for replay at most")
    hwm: int = Field(
        100_000,
        ge=1,
        description=(
            "messages queued per subscriber before ZMQ drops "
            "(ZMQ's 0, no limit, is refused: a slow subscriber would grow memory)"
        ),
    )
    data_parallel_rank: int | None = Field(
        None, ge=0, description="set in every batch when given (engines set it; a node does not)"
    )
    close_linger_ms: int = Field(
        500, ge=0, description="how long close() lets ZMQ deliver what it already queued"
    )


@dataclass(frozen=True)
class PublisherStats:
    """Counts since the publisher started (``EventPublisher.stats``)."""

    published_events: int
    published_batches: int
    dropped_events: (
        int  # by publish, on a full queue (the PUB socket's own drops are not seen here)
    )
    next_sequence: int  # the sequence number the next batch gets (gaps included)
    skipped_sequences: int  # numbers no batch got: one per run of dropped publish calls
    replay_requests: int
    queued_events: int
    refused_handshakes: int = 0  # connections without a CURVE handshake this node accepts
    refused_keys: int = 0  # CURVE handshakes of a key the routers file does not list
    refused_subscriptions: int = 0  # subscriptions to topics of no tenant the router reads
    rebinds: int = 0  # times a narrowed routers file made every router handshake again
