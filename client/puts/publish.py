"""Puts: pages onto their rendezvous replicas (``Publisher``), each page's checksum
computed once however many replicas it goes to (``ChecksumOnce``), and what a put
reports (``PublishReport``)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from client.lookups.registration import NamespaceRegistration
from client.memory.buffers import Span
from client.nodes.calls import NodeRefusedError, OutgoingPage, PutOutcome
from client.nodes.credentials import CallRefusals
from client.nodes.directory import NodeDirectory
from client.nodes.placement import place
from client.stats import ClientStats
from kvstore.errors import InvalidInputError, RemoteFault
from kvstore.index import NodeInfo
from kvstore.pages import heads, keys
from kvstore.pages.checksum import HashAhead, checksums
from kvstore.pages.namespace import Namespace
from kvstore.wire import protocol as P

log = logging.getLogger(__name__)
# Most a UCX put hashes ahead while its plan is on its way (``ChecksumOnce.ahead``):
# about 5 ms of the helper thread, the longest a same-host copy of this client can
# wait behind it for its half of the work, and the most hashed in vain when the
# node holds the pages already.
HASH_AHEAD_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PublishReport:
    """Outcome of a put: pages now stored (sent now or already there), sent, refused."""

    stored: int
    sent: int
    skipped: int
    refused: int
    bytes_sent: int


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What one put publishes, page by page: keys, bytes, and each page's segment
    anchor and position in the index (``keys.placement``; head groups of a block share
    their block's)."""

    hashes: list[bytes]
    spans: list[Span]
    anchors: list[bytes]
    positions: list[int]
    tokens: list[bytes] | None = None  # per page, its block's token ids (u32 LE): KV events
    # every page's size where the keys fix it (a unit: a put's blocks or engine keys);
    # None where the caller's spans say (``insert``'s tail parts)
    nbytes: int | None = None

    def __add__(self, other: Outgoing) -> Outgoing:
        return Outgoing(
            self.hashes + other.hashes,
            self.spans + other.spans,
            self.anchors + other.anchors,
            self.positions + other.positions,
            self.tokens + other.tokens
            if self.tokens is not None and other.tokens is not None
            else None,
            self.nbytes if self.nbytes == other.nbytes else None,
        )


class Publisher:
    """One job: store pages on their ``replicas`` rendezvous nodes and report what is
    stored. A page counts as stored when at least one replica holds it; pages a node
    holds already are not sent again. A node that fails is suspected and its pages
    count as refused; a call that every node asked refused for the client's token
    raises ``CredentialError``. Runs on the client's event loop."""

    def __init__(
        self,
        nodes: NodeDirectory,
        registration: NamespaceRegistration,
        stats: ClientStats,
        namespace: Namespace,
        rank: heads.RankUnits,
        *,
        replicas: int,
        timeout: float,
    ) -> None:
        self._nodes = nodes
        self._registration = registration
        self._stats = stats
        self._namespace = namespace
        self._key = namespace.storage.key
        self._rank = rank
        self._replicas = replicas
        self._timeout = timeout

    def unit_keys(
        self,
        hashes: list[bytes],
        verb: str,
        start: int = 0,
        chain: keys.ChainPlace = keys.TOKEN_CHAIN,
    ) -> Outgoing:
        """The keys of this rank's units of blocks ``hashes[start:]`` (``hashes``: the
        chain from block 0, which places every block in its segment), unit by unit, and
        each unit's segment anchor and position (its block's; ``chain``: where the chain
        lies in its segments, ``keys.ChainPlace``), each a unit of the namespace
        (``nbytes``); no bytes yet. Raises unless the rank holds whole head groups: only
        those can be stored (``PageWriter``'s puts, ``insert``)."""
        rank = self._rank
        if not rank.whole:
            ns = self._namespace
            raise InvalidInputError(
                f"this rank holds part of a head group ({ns.groups} groups of {ns.group_heads} heads "
                f"for tp_size {ns.tp_size}): "
                f"it can read pages but not {verb} them; use head_groups of at least tp_size"
            )
        anchors, positions = keys.placement(
            hashes, span=chain.span, offset=chain.offset, head_anchor=chain.head_anchor
        )
        hashes, anchors, positions = hashes[start:], anchors[start:], positions[start:]
        return Outgoing(
            heads.unit_hashes(hashes, rank.first, rank.count),
            [],
            anchors * rank.count,
            positions * rank.count,
            nbytes=self._namespace.unit_nbytes,
        )

    async def publish(self, out: Outgoing) -> PublishReport:
        """Store each page of ``out`` on its replicas (the namespace registered first
        while that has not succeeded)."""
        hashes = out.hashes
        await self._registration.ensure()
        nodes = {n.node_id: n for n in await self._nodes.live()}
        if not nodes or not hashes:
            self._stats.pages_refused += len(hashes)
            return PublishReport(0, 0, 0, len(hashes), 0)
        pages = [
            OutgoingPage(
                h,
                out.spans[i],
                i,
                out.anchors[i],
                out.positions[i],
                out.tokens[i] if out.tokens else b"",
            )
            for i, h in enumerate(hashes)
        ]
        checksum = ChecksumOnce()
        per_node: dict[str, list[int]] = defaultdict(list)
        for i, h in enumerate(hashes):
            for node_id in place(h, list(nodes), self._replicas):
                per_node[node_id].append(i)
        refusals = CallRefusals(self._stats, self._key.tenant, "store")
        outcomes = await asyncio.gather(
            *(
                self._put_on(nodes[n], [pages[i] for i in idx], checksum, refusals)
                for n, idx in per_node.items()
            )
        )
        refusals.raise_if_all(set(per_node))
        return self._tally(len(hashes), zip(per_node.values(), outcomes))

    async def _put_on(
        self,
        node: NodeInfo,
        pages: list[OutgoingPage],
        checksum: ChecksumOnce,
        refusals: CallRefusals,
        retried: bool = False,
    ) -> PutOutcome | None:
        """Put ``pages`` on ``node``; the node's outcome, or None when it failed or
        refused. An index that lost the namespace (restarted empty) gets it registered
        again, and the put is made once more, so a store's restart loses no save."""
        try:
            outcome, conn = await self._nodes.on_node(
                node, lambda c: c.put(self._key, pages, checksum, self._timeout)
            )
        except NodeRefusedError as exc:
            if exc.credentials:
                refusals.add_refusal(exc)
                return None
            if exc.code is not P.RefusalCode.UNKNOWN_NAMESPACE:
                self._nodes.failed(node.node_id, exc)
                return None
            # The index lost the namespace (it restarted empty): register it again and
            # put once more. That is routine after a store's restart and loses nothing,
            # so it is said at INFO; only a put that still fails is a WARNING.
            if not retried:
                log.info(
                    "%s does not know this client's namespace (the index restarted?): "
                    "registering it again and repeating the put of %d page(s)",
                    node.node_id,
                    len(pages),
                )
                await self._registration.again()
                if self._registration.registered:
                    return await self._put_on(node, pages, checksum, refusals, retried=True)
            self._nodes.log_limit.warning(
                "put unregistered",
                "%d page(s) were not stored on %s: the namespace is not registered "
                "in the index (%s)",
                len(pages),
                node.node_id,
                self._registration.error or exc,
            )
            return None
        except RemoteFault as exc:
            self._nodes.failed(node.node_id, exc)
            return None
        self._nodes.ok(node.node_id)
        if conn.path == "shm":
            self._stats.same_host_transfers += 1
        return outcome

    def _tally(
        self, total: int, outcomes: Iterable[tuple[list[int], PutOutcome | None]]
    ) -> PublishReport:
        """A put's report from each node's outcome (``(indexes, outcome)`` pairs)."""
        held: set[int] = set()
        sent = skipped = nbytes = 0
        for idx, outcome in outcomes:
            if outcome is None:
                continue
            held.update(idx[k] for k in outcome.stored + outcome.present)
            sent += len(outcome.stored)
            skipped += len(outcome.present)
            nbytes += outcome.bytes_sent
        refused = total - len(held)
        self._stats.pages_sent += sent
        self._stats.pages_skipped += skipped
        self._stats.pages_refused += refused
        self._stats.bytes_sent += nbytes
        return PublishReport(len(held), sent, skipped, refused, nbytes)


class ChecksumOnce:
    """A put's page checksums, each computed once and, beyond what ``ahead`` hashes
    while a plan is on its way, only for pages some node asks for (a node that already
    holds a page makes the client hash it only if it was hashed ahead). Satisfies
    ``client.nodes.calls.Checksums``."""

    def __init__(self) -> None:
        self._memo: dict[int, int] = {}  # written by the helper thread too (one key per page)

    def of(self, pages: list[OutgoingPage]) -> list[int]:
        """The pages' checksums, the missing ones computed on two threads."""
        missing = [p for p in pages if p.index not in self._memo]
        for page, digest in zip(missing, checksums([p.span.view() for p in missing])):
            self._memo.setdefault(page.index, digest)
        return [self._memo[p.index] for p in pages]

    def ahead(self, pages: list[OutgoingPage]) -> HashAhead:
        """Start hashing ``pages`` (those in one piece, not hashed yet, up to
        ``HASH_AHEAD_BYTES``) on the helper thread; ``stop`` it when the plan is in."""
        todo: list[OutgoingPage] = []
        nbytes = 0
        for page in pages:
            if page.index in self._memo or page.span.pieces:
                continue
            if nbytes + page.span.nbytes > HASH_AHEAD_BYTES:
                break
            todo.append(page)
            nbytes += page.span.nbytes
        return HashAhead(
            [p.span.view() for p in todo],
            lambda k, digest: self._memo.setdefault(todo[k].index, digest),
        )

    def record(self, page: OutgoingPage, digest: int) -> None:
        """A checksum computed while the page was packed (UCX puts of scattered pages)."""
        self._memo.setdefault(page.index, digest)
