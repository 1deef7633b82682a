"""The built-in put sources, to the nodes (``client.puts.handlers``): ``FromPages``
(``put_pages``: this rank's pages in a tensor, host or device memory) and ``FromSpans``
(``put_keyed``, ``insert``: pages in spans of the caller's host memory). Registered
when ``client.puts.writes`` imports this module. Both hand the writer spans of host
memory the pages are sent from; neither checksums nor sends anything itself."""

from __future__ import annotations

from client.codec import check_pages
from client.gets.handlers import NODES, register_handler
from client.memory.buffers import host_bytes, page_spans
from client.puts.handlers import Writer
from client.puts.plan import FromPages, FromSpans
from client.puts.publish import Outgoing, PublishReport
from kvstore.errors import InvalidInputError
from kvstore.pages import heads


class PagesSource:
    """Rank pages ``[blocks, *page_shape]``, exactly one per block of the plan's keys:
    device pages copied to the host, then split into the rank's head-group units
    (``heads.split``; no copy for a contiguous host tensor of whole pages), unit by
    unit as the keys are."""

    async def send(self, writer: Writer, keys: Outgoing, source: FromPages) -> PublishReport:
        ns, rank = writer.namespace, writer.rank
        count = len(keys.hashes) // rank.count
        check_pages(ns, "pages", source.pages, count, at_least=False)
        pages = source.pages[:count].to("cpu")
        units = pages.contiguous() if rank.identity else heads.split(ns, pages, rank)
        spans = page_spans(host_bytes(units), count * rank.count, ns.unit_nbytes)
        return await writer.publish(keys, spans)


class SpansSource:
    """Pages in the caller's spans, one per key, each of the size the keys fix (where
    they do), sent from there."""

    async def send(self, writer: Writer, keys: Outgoing, source: FromSpans) -> PublishReport:
        spans, size = source.spans, keys.nbytes
        if len(spans) != len(keys.hashes):
            raise InvalidInputError(f"{len(spans)} pages for {len(keys.hashes)} keys")
        bad = (
            None
            if size is None
            else next((i for i, s in enumerate(spans) if s.nbytes != size), None)
        )
        if bad is not None:
            raise InvalidInputError(
                f"page {bad} holds {spans[bad].nbytes} bytes; a page of this namespace is {size}"
            )
        return await writer.publish(keys, spans)


register_handler(FromPages, NODES, PagesSource())
register_handler(FromSpans, NODES, SpansSource())
