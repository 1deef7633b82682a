"""Puts: every put runs here, as a plan (``client.puts.plan.PutPlan``) through the
handler of its (source, destination) pair (``client.gets.handlers``, the registry gets
use too): ``PageWriter``. The public put methods of both clients are views that build
a plan and put it (``client.puts.views``); ``insert`` puts a plan of keys it placed
itself (``client.sequences``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from client.gets.handlers import handler_for
from client.lookups.prefix import PrefixLookup
from client.memory.buffers import Span

# the built-in sources register themselves on import (client.puts.handlers)
from client.puts import host_sources  # noqa: F401
from client.puts.plan import Blocks, EngineKeys, Placed, PutPlan
from client.puts.publish import Outgoing, Publisher, PublishReport
from kvstore.errors import InvalidInputError
from kvstore.pages.hashing import split_hashes, token_array
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace


@dataclass(frozen=True, slots=True)
class PageWriter:
    """One job: store pages on their replicas as a plan says (``put``): the plan's keys
    resolved here (``keys``), its pages read from its source by the handler of its
    pair, and published by the ``Publisher`` (checksums once per page, replicas, the
    report). Misuse raises ``InvalidInputError`` before anything is sent. Called by both
    clients' ``put`` (``put_pages`` and ``put_keyed`` are views of it) and by ``insert``
    (``client.sequences``); runs on the client's event loop, ``keys`` on any thread. It
    is the ``client.puts.handlers.Writer`` handlers see."""

    publisher: Publisher
    lookups: PrefixLookup
    namespace: Namespace
    rank: RankUnits

    async def put(self, plan: PutPlan) -> PublishReport:
        """Run ``plan``: the handler of its (source kind, destination) pair sends the
        pages its keys name; returns what is stored (``PublishReport``, counted in units:
        pages of one head group)."""
        handler = handler_for(type(plan.source), plan.destination)
        return await handler.send(self, self.keys(plan.pages), plan.source)

    def keys(self, pages: Blocks | EngineKeys | Placed) -> Outgoing:
        """The keys of ``pages``, unit by unit, each with its segment anchor and
        position (an ``Outgoing`` without spans): a prompt's blocks with their token ids,
        an engine's keys as one unit each, or what a caller placed. Raises for blocks
        outside the prompt and for a rank that cannot store what it holds."""
        if isinstance(pages, Placed):
            return pages.keys
        publisher, lookups = self.publisher, self.lookups
        if isinstance(pages, EngineKeys):
            hashes = split_hashes(lookups.keyed_hashes(pages.page_keys))
            place = lookups.keyed_place(pages.position, pages.anchor_key)
            keyed = publisher.unit_keys(hashes, "store", chain=place)
            if not self.rank.identity:
                raise InvalidInputError(
                    f"put_keyed needs a rank whose page is one unit; this rank holds {self.rank.count}"
                )
            return keyed
        hashes = split_hashes(lookups.chain_hashes(pages.token_ids, pages.identity))
        start = pages.start_block
        if not 0 <= start <= len(hashes):
            raise InvalidInputError(
                f"start_block {start} must lie within the {len(hashes)} full blocks of token_ids"
            )
        out = publisher.unit_keys(hashes, "store", start)
        # each block's token ids go with its pages, for the nodes' KV events (4 bytes a token)
        count, size = len(hashes) - start, self.namespace.block_size
        raw = token_array(pages.token_ids)[start * size : (start + count) * size].tobytes()
        width = 4 * size
        blocks = [raw[i * width : (i + 1) * width] for i in range(count)]
        return dataclasses.replace(out, tokens=blocks * self.rank.count)  # unit by unit

    async def publish(self, keys: Outgoing, spans: list[Span]) -> PublishReport:
        """Store page ``spans[i]`` under ``keys``' i-th key on its replicas."""
        return await self.publisher.publish(dataclasses.replace(keys, spans=spans))
