"""What one call to a storage node carries and returns, for both connections
(``client.nodes.connection``, ``client.nodes.shm_connection``) and their callers: the pages of a
put and their checksums, the outcomes of a put and a get, the ways a node refuses or a
connection fails, and the request frames."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from client.memory.buffers import Span, join_flags
from kvstore.errors import TransportError
from kvstore.pages.checksum import HashAhead
from kvstore.pages.keys import NamespaceKey
from kvstore.wire import protocol as P


class NodeRefusedError(TransportError):
    """The node answered with an ERROR frame (``code`` says why); the connection stays
    usable, except after ``unauthorized``, where the node closes it (and so does the
    client)."""

    def __init__(self, node_id: str, code: P.RefusalCode, message: str) -> None:
        super().__init__(f"node {node_id} refused: {code.value}: {message}")
        self.node_id = node_id
        self.code = code
        self.message = message

    @property
    def credentials(self) -> bool:
        """Refused for the client's token (none, wrong, lacking the right), not a fault."""
        return self.code in (P.RefusalCode.UNAUTHORIZED, P.RefusalCode.FORBIDDEN)


class ClosedBeforeUseError(TransportError):
    """The connection was closed (by another request's failure or refusal) while this
    request waited for it; nothing was sent, so the caller may retry on a new one."""


class NodeClosedBeforeUseError(ClosedBeforeUseError):
    """The node itself had closed the connection (it restarted: the registry may name a
    new incarnation, on a new socket) before this request was sent."""


class SameHostUnavailableError(TransportError):
    """The node's Unix socket cannot be reached from here (another container's
    filesystem, permissions): the client uses UCX for that node instead."""


@dataclass(frozen=True, slots=True)
class OutgoingPage:
    hash: bytes
    span: Span
    index: int  # position in the caller's batch (keys its checksum memo)
    anchor: bytes  # its segment in the index and its place there (kvstore.pages.keys.placement)
    position: int
    tokens: bytes = b""  # its block's token ids (u32 LE), for the node's KV events; b"": none


@dataclass(frozen=True, slots=True)
class PutOutcome:
    stored: list[int]
    present: list[int]
    refused: list[int]
    bytes_sent: int


# The index's checksums of a get's pages, in request order (a list, or uint64 array).
Expected = Sequence[int] | np.ndarray


@dataclass(slots=True)
class GetOutcome:
    """Request positions whose bytes arrived and match the expected checksum, and how
    many arrived with a wrong one."""

    ok: list[int]
    corrupt: int

    def check(self, i: int, node_checksum: int, expected: int, digest: int) -> None:
        """Count page ``i``: good only if the node's record and the bytes' ``digest``
        both equal the index's checksum."""
        if node_checksum == expected == digest:
            self.ok.append(i)
        else:
            self.corrupt += 1


class Checksums(Protocol):
    """A put's page checksums (xxh3-64), each computed at most once per put, however
    many replicas it goes to: ``record`` keeps one computed while the page was packed,
    ``ahead`` hashes pages on the helper thread while a plan is on its way."""

    def of(self, pages: list[OutgoingPage]) -> list[int]: ...

    def record(self, page: OutgoingPage, digest: int) -> None: ...

    def ahead(self, pages: list[OutgoingPage]) -> HashAhead: ...


def put_request(
    namespace: NamespaceKey, token: str, pages: list[OutgoingPage], with_tokens: bool = False
) -> P.PutRequest:
    """The PUT of ``pages``; with their token ids when ``with_tokens`` (the node
    advertises ``put_tokens``) and every page has the same number of them."""
    width = len(pages[0].tokens) if pages else 0
    send = with_tokens and width and all(len(p.tokens) == width for p in pages)
    return P.PutRequest(
        token_ids=np.frombuffer(b"".join(p.tokens for p in pages), dtype="<u4") if send else (),
        namespace=namespace.digest,
        tenant=namespace.tenant,
        token=token,
        hashes=[p.hash for p in pages],
        sizes=np.fromiter((p.span.nbytes for p in pages), dtype=np.uint64, count=len(pages)),
        join=join_flags([p.span for p in pages]),
        anchors=[p.anchor for p in pages],
        positions=[p.position for p in pages],
    )


def get_request(
    namespace: NamespaceKey,
    token: str,
    hashes: list[bytes],
    sinks: Sequence[Any],
    probe: bool,
    part_pages: int = 0,
) -> P.GetRequest:
    """The GET of ``hashes`` into ``sinks``: host spans say which pages may travel in
    one message (``join_flags``); device spans (client.memory.device_pages) never do.
    ``part_pages``: its plan in parts of that many pages (same host; 0: one plan)."""
    host = not sinks or isinstance(sinks[0], Span)  # one kind per get
    return P.GetRequest(
        namespace=namespace.digest,
        tenant=namespace.tenant,
        token=token,
        hashes=hashes,
        join=join_flags(list(sinks)) if host else np.zeros(len(hashes), dtype=bool),
        probe=probe,
        part_pages=part_pages,
    )


def slot_reads(namespace: NamespaceKey, token: str, hashes: list[bytes]) -> P.SlotReads:
    """The node's notice of pages read straight from their slots
    (``client.nodes.slot_reads``)."""
    return P.SlotReads(
        namespace=namespace.digest, tenant=namespace.tenant, token=token, hashes=hashes
    )
