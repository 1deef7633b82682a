"""Handlers: how pages from one source land in one kind of destination, registered per
(source, destination kind) pair (``register_handler``), in the spirit of vLLM's
``OffloadingWorker.register_handler``. ``PageReader.read`` (``client.gets.reads``)
runs every ``GetPlan`` through the handler of its pair (``handler_for``).

One registry serves both directions: a get's pair is (``NODES``, a ``Destination``
kind), a put's (a ``client.puts.plan.Source`` kind, ``NODES``), its handler a
``client.puts.handlers.PutHandler``; ``PageWriter.put`` (``client.puts.writes``) runs
every ``PutPlan`` through it. The kind side of a pair is matched by its nearest
registered base class.

The built-in handlers register themselves when ``client.gets.reads`` imports them:
``client.gets.host_handlers`` (rank pages in a tensor, spans, head-group units) and
``client.gets.device_handlers`` (device rows, layer by layer). A new medium is one
module: a ``Destination`` subclass, a handler, and its ``register_handler`` call at
import; a caller imports it and passes its plans to the client's ``read``
(``client.gets.file_handler``: pages into a file; ``client.gets.sequence_handler``:
a sequence's blocks into key/value and its tail parts into a buffer, which
``client.sequences`` imports for ``select``).

A handler moves no bytes itself: it asks the reader (``Reader``) to fetch pages into
spans or device rows, which the nodes' connections fill and check (the same-host and
UCX paths, the device copier), so every handler inherits their checks and speed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import torch

from client.gets.landing import TransferMode
from client.gets.plan import NODES as NODES  # handler modules register their pairs with it
from kvstore.errors import InvalidInputError

if TYPE_CHECKING:
    from client.gets.plan import Destination, FoundPages
    from client.memory.buffers import Span
    from client.memory.device_pages import DeviceCopier
    from client.memory.device_rows import DeviceRows
    from client.memory.staging import HostBuffers
    from client.puts.handlers import PutHandler
    from client.puts.plan import Source
    from client.stats import ClientStats
    from kvstore.index import LookupResult
    from kvstore.pages.heads import RankUnits
    from kvstore.pages.namespace import Namespace

D = TypeVar("D", bound="Destination[Any]")
S = TypeVar("S", bound="Source")
D_contra = TypeVar("D_contra", bound="Destination[Any]", contravariant=True)
R_co = TypeVar("R_co", covariant=True)


class Reader(Protocol):
    """What a handler may ask of the reader running its plan (``PageReader``): the
    client's namespace, rank, counters, host buffers and device copier, and fetches of
    a plan's pages (and a sequence's tail parts) into spans or device rows, each page
    checked where it lands."""

    @property
    def namespace(self) -> Namespace: ...

    @property
    def rank(self) -> RankUnits: ...

    @property
    def stats(self) -> ClientStats: ...

    @property
    def buffers(self) -> HostBuffers: ...

    @property
    def device(self) -> DeviceCopier | None: ...

    @property
    def transfer_mode(self) -> TransferMode: ...

    def lands_on_device(self, memory: torch.device) -> bool: ...

    def units_nbytes(self, blocks: int) -> int: ...

    def in_place_spans(self, out: torch.Tensor, blocks: slice) -> list[Span] | None: ...

    async def fetch_pages(self, pages: FoundPages, spans: list[Span] | DeviceRows) -> list[bool]:
        """Whole pages of ``pages`` into ``spans`` (one per block): per page, whether it
        arrived intact."""
        ...

    async def fetch_into(self, pages: FoundPages, spans: list[Span] | DeviceRows) -> int:
        """``fetch_pages``: the tokens of the prefix that arrived."""
        ...

    async def fetch_units(
        self,
        hashes: list[bytes],
        result: LookupResult,
        start_block: int,
        buf: torch.Tensor,
        end: int | None = None,
    ) -> tuple[torch.Tensor, int]: ...

    async def fetch_sequence(
        self, pages: FoundPages, spans: list[Span], *, units: bool = True
    ) -> list[bool]:
        """This rank's units of ``pages``' blocks (unless not ``units``), then the tail
        parts found after them, into ``spans`` in one fetch: per request, whether it
        arrived intact."""
        ...


class GetHandler(Protocol[D_contra, R_co]):
    """Lands a plan's pages in one kind of destination. ``check`` runs before the
    lookup (``count``: the blocks the plan may fetch, possibly none) and raises
    ``InvalidInputError`` for a destination the pages cannot land in; ``empty`` is what
    a get that fetched nothing returns; ``land`` fetches ``pages`` (at least one block)
    and returns what the caller's get returns (``Destination``'s ``R``), with no byte
    landing after it returned (cancelled too). ``checks``: where each page's checksum
    is verified, "host" or "device"."""

    @property
    def checks(self) -> str: ...

    def check(self, reader: Reader, into: D_contra, count: int) -> None: ...

    def empty(self, reader: Reader, into: D_contra) -> R_co: ...

    async def land(self, reader: Reader, pages: FoundPages, into: D_contra) -> R_co: ...


_HANDLERS: dict[tuple[Any, Any], Any] = {}


@overload
def register_handler(
    source: str, destination: type[D], handler: GetHandler[D, Any], *, replace: bool = False
) -> None: ...


@overload
def register_handler(
    source: type[S], destination: str, handler: PutHandler[S], *, replace: bool = False
) -> None: ...


def register_handler(source: Any, destination: Any, handler: Any, *, replace: bool = False) -> None:
    """Land plans from ``source`` into ``destination`` (a get: ``NODES`` and a
    ``Destination`` subclass) or send them from ``source`` to ``destination`` (a put: a
    ``Source`` subclass and ``NODES``) with ``handler``; the kind covers its subclasses
    unless they have their own. A pair has one handler: registering it again raises
    ``ValueError`` unless ``replace``."""
    key = (source, destination)
    if key in _HANDLERS and not replace:
        raise ValueError(f"a handler for {_pair(source, destination)} is registered")
    _HANDLERS[key] = handler


@overload
def handler_for(source: str, destination: type[Any]) -> GetHandler[Any, Any]: ...


@overload
def handler_for(source: type[Any], destination: str) -> PutHandler[Any]: ...


def handler_for(source: Any, destination: Any) -> Any:
    """The handler of ``(source, destination)``, or of the kind's nearest registered
    base class; ``InvalidInputError`` naming the registered pairs when there is none."""
    put = isinstance(source, type)
    for kind in (source if put else destination).__mro__:
        handler = _HANDLERS.get((kind, destination) if put else (source, kind))
        if handler is not None:
            return handler
    pairs = ", ".join(_pair(s, d) for s, d in _HANDLERS)
    what = "sends pages from {} to {}" if put else "lands pages from {} into {}"
    raise InvalidInputError(
        f"no handler {what.format(_name(source), _name(destination))} (registered: {pairs})"
    )


def registered() -> list[tuple[Any, Any]]:
    """The registered (source, destination) pairs, gets' and puts', in registration order."""
    return list(_HANDLERS)


def _name(side: Any) -> str:
    return side.__name__ if isinstance(side, type) else str(side)


def _pair(source: Any, destination: Any) -> str:
    return f"{_name(source)} -> {_name(destination)}"
