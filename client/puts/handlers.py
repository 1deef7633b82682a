"""What a put handler is and what it may ask of the writer running its plan: how pages
are read from one kind of source (``client.puts.plan.Source``) and sent to the nodes.
Handlers are registered in the one registry gets use too
(``client.gets.handlers.register_handler(Kind, NODES, handler)``), and
``PageWriter.put`` (``client.puts.writes``) runs every ``PutPlan`` through the handler
of its pair.

The built-in handlers register themselves when ``client.puts.writes`` imports them:
``client.puts.host_sources`` (rank pages in a tensor, host or device; spans of the
caller's host memory). A new source is one module: a ``Source`` subclass, a handler,
and its ``register_handler`` call at import; a caller imports it and passes its plans
to the client's ``put`` (``client/puts/file_source.py`` reads pages from a file).

A handler moves no bytes itself: it hands the writer spans of host memory, one per
page of the plan's keys, which the publisher checksums once and the nodes'
connections send (the same-host and UCX paths), so every handler inherits their
checks, replicas and speed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from client.memory.buffers import Span
    from client.puts.plan import Source
    from client.puts.publish import Outgoing, PublishReport
    from kvstore.pages.heads import RankUnits
    from kvstore.pages.namespace import Namespace

S_contra = TypeVar("S_contra", bound="Source", contravariant=True)


class Writer(Protocol):
    """What a put handler may ask of the writer running its plan (``PageWriter``): the
    client's namespace and rank, and the publish of the plan's pages from spans."""

    @property
    def namespace(self) -> Namespace: ...

    @property
    def rank(self) -> RankUnits: ...

    async def publish(self, keys: Outgoing, spans: list[Span]) -> PublishReport:
        """Store page ``spans[i]`` under ``keys``' i-th key on its replicas (the spans
        must stay valid and unchanged until this returns)."""
        ...


class PutHandler(Protocol[S_contra]):
    """Sends a plan's pages from one kind of source. ``send`` gets the pages' keys
    (``keys``: an ``Outgoing`` without spans, unit by unit; ``keys.nbytes`` each page's
    size where the keys fix it) and the plan's source; it raises ``InvalidInputError``
    for a source that does not hold those pages, before anything is sent, and returns
    the writer's report of ``publish``."""

    async def send(self, writer: Writer, keys: Outgoing, source: S_contra) -> PublishReport: ...
