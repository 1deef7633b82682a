"""A put described once (``PutPlan``): which pages, under which keys (a prompt's full
blocks under its chain hashes and identity, an engine's own page keys, or keys a caller
placed itself), from which source memory (one of the ``From*`` specs here, or one a
handler module adds), to the nodes, each page on its rendezvous replicas. Every put
runs through ``PageWriter.put`` (``client.puts.writes``), which resolves the keys and
hands them with the source to the handler registered for the plan's (source,
destination) pair (``client.gets.handlers``: one registry for gets and puts).

How pages are checked is no choice a plan makes: each page's xxh3 checksum is computed
once on the host, however many replicas it goes to (``client.puts.publish``), and each
node checks it as the page lands there.

The plan builders below (``pages_put_plan``, ``keyed_put_plan``) are the public put
methods' one signature and documentation: ``AsyncKVCacheClient`` and ``KVCacheClient``
make each method from its builder (``client.puts.views``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from client.gets.plan import NODES
from client.lookups.prefix import Identity
from client.memory.buffers import Span
from client.puts.publish import Outgoing


@dataclass(frozen=True, slots=True)
class Blocks:
    """Full blocks ``start_block`` on of a prompt, keyed by its chain hashes under
    ``identity``; each block's token ids go with its pages (the nodes' KV events)."""

    token_ids: Any
    identity: Identity = None
    start_block: int = 0


@dataclass(frozen=True, slots=True)
class EngineKeys:
    """Pages of a keyed layout (``Namespace.keyed``) under an engine's own page keys,
    one whole page each, placed from chain ``position`` (``anchor_key``: as for
    ``find_keys``); no token ids go with them."""

    page_keys: list[str]
    position: int | None = None
    anchor_key: str | None = None


@dataclass(frozen=True, slots=True)
class Placed:
    """Keys a caller resolved and placed itself (``keys``: an ``Outgoing`` without
    spans): ``insert``'s units of its blocks and the parts of its sequence's tail."""

    keys: Outgoing


class Source:
    """Where a put's pages are read from. A subclass is a source kind: handlers are
    registered by it (``client.gets.handlers.register_handler(Kind, NODES, handler)``)."""


@dataclass(frozen=True, eq=False)
class FromPages(Source):
    """This rank's pages in a tensor, ``pages[i]`` the page of the plan's i-th block
    (``[blocks, *page_shape]``, exactly as many as there are blocks), in host or device
    memory (device pages are copied to the host first), split into the head-group
    units the rank holds."""

    pages: torch.Tensor


@dataclass(frozen=True, eq=False)
class FromSpans(Source):
    """Pages in spans of the caller's host memory (a span of an array, or its pieces:
    ``client.memory.buffers``), ``spans[i]`` the page of the plan's i-th key, sent from
    there with no copy of the client's."""

    spans: list[Span]


@dataclass(frozen=True, eq=False)
class PutPlan:
    """One put: ``pages`` (which pages, under which keys) read from ``source``, stored
    on their replicas among ``destination`` (``NODES``: the nodes, each reached over
    shared memory on the same host or over UCX, as its connection chooses)."""

    pages: Blocks | EngineKeys | Placed
    source: Source
    destination: str = NODES


# ---- the public put methods' one signature each (client.puts.views) -------------------


def pages_put_plan(
    token_ids: Any,
    pages: torch.Tensor,
    *,
    identity: Identity = None,
    start_block: int = 0,
) -> PutPlan:
    """Store ``pages[i]`` (``[num_blocks, *page_shape]``) as full block
    ``start_block + i`` of ``token_ids``: as the head groups this rank holds, which
    engines of any TP size read. Pages a node already holds are not sent again;
    counts in the report are units (pages of one head group). ``identity``: as for
    ``lookup``. ``start_block``: the caller has no pages of the blocks before it
    (the vLLM connector's hybrid engines, whose sliding layers keep no blocks below
    their window after a hit); they are found only while stored already."""
    return PutPlan(Blocks(token_ids, identity, start_block), FromPages(pages))


def keyed_put_plan(
    page_keys: list[str],
    spans: list[Span],
    *,
    position: int | None = None,
    anchor_key: str | None = None,
) -> PutPlan:
    """Store page ``spans[i]`` (this rank's page, in host memory: a span of an
    array, or its pieces, ``client.memory.buffers``) under ``page_keys[i]``, for a
    keyed layout; ``position`` and ``anchor_key`` as for ``find_keys``. Pages a node
    holds already are not sent again; no token ids go with them (the nodes' KV
    events name such pages by hash alone)."""
    return PutPlan(EngineKeys(page_keys, position, anchor_key), FromSpans(spans))
