"""A put whose pages are read from a file (``FromFile``): a source added as one module,
the way any other is (``client.puts.handlers``). Importing it registers its handler for
(``FromFile``, the nodes); a caller passes its plans to the client's ``put``::

    from client.puts.file_source import file_put_plan
    report = client.put(file_put_plan(token_ids, "/scratch/prefix.kv"))

The file holds this rank's whole pages back to back from byte ``offset`` on, one per
full block of ``token_ids`` from ``start_block`` on (what ``client.gets.file_handler``
writes). They are sent from a read-only mapping of the file, with no copy of the
client's, as ``put_keyed`` sends pages from the caller's spans: checksummed once
whatever the replicas, copied into a node's slots on the same host, sent over UCX
otherwise, each block's token ids with it. A file shorter than the pages it must
hold is refused before anything is sent; the file must not change until ``put``
returned. Whole pages only (a rank whose head groups are its whole pages)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.gets.handlers import NODES, register_handler
from client.lookups.prefix import Identity
from client.memory.buffers import page_spans
from client.puts.handlers import Writer
from client.puts.plan import Blocks, PutPlan, Source
from client.puts.publish import Outgoing, PublishReport
from kvstore.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class FromFile(Source):
    """Whole pages back to back in the file at ``path``, from byte ``offset`` on."""

    path: str | os.PathLike[str]
    offset: int = 0


class FileSource:
    """Sends the plan's pages from a read-only mapping of its file."""

    async def send(self, writer: Writer, keys: Outgoing, source: FromFile) -> PublishReport:
        if not writer.rank.identity:
            raise InvalidInputError("pages are read from a file only for a rank of whole pages")
        if source.offset < 0:
            raise InvalidInputError(f"offset must not be negative, got {source.offset}")
        page, count = writer.namespace.page_nbytes, len(keys.hashes)
        size, need = os.stat(source.path).st_size, source.offset + count * page
        if size < need:
            raise InvalidInputError(
                f"{os.fspath(source.path)} holds {size} bytes; {count} pages from byte "
                f"{source.offset} need {need}"
            )
        if not count:
            return await writer.publish(keys, [])
        mapped = np.memmap(
            source.path, dtype=np.uint8, mode="r", offset=source.offset, shape=count * page
        )
        try:
            return await writer.publish(keys, page_spans(mapped, count, page))
        finally:
            del mapped


def file_put_plan(
    token_ids: Any,
    path: str | os.PathLike[str],
    *,
    identity: Identity = None,
    start_block: int = 0,
    offset: int = 0,
) -> PutPlan:
    """Full blocks ``start_block`` on of ``token_ids`` (under ``identity``), their pages
    read from the file at ``path`` from byte ``offset`` on (the module docstring)."""
    return PutPlan(Blocks(token_ids, identity, start_block), FromFile(path, offset))


register_handler(FromFile, NODES, FileSource())
