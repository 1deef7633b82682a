"""A get whose pages land in a file (``IntoFile``): a medium added as one module, the
way any other is (``client.gets.handlers``). Importing it registers its handler for
(the nodes, ``IntoFile``); a caller passes its plans to the client's ``read``::

    from client.gets.file_handler import file_plan
    tokens = client.read(file_plan(client.find(token_ids), "/scratch/prefix.kv"))

Pages of blocks ``start_block`` on land back to back in the file from ``offset`` (the
file is created or grown to hold them), each received straight into a mapping of the
file and checked there against its checksum, as ``get_found_into`` lands pages in
host memory: from a node's slots with one copy on the same host, over UCX into the
mapping. The bytes past the prefix that arrived are unspecified. Whole pages only (a
rank whose head groups are its whole pages); the file's bytes reach the disk when the
kernel writes the mapping back (``os.fsync`` the file for more)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from client.gets.handlers import NODES, Reader, register_handler
from client.gets.plan import Destination, FoundPages, GetPlan
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import page_spans
from kvstore.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class IntoFile(Destination[int]):
    """Whole pages back to back in the file at ``path``, from byte ``offset`` on."""

    path: str | os.PathLike[str]
    offset: int = 0


class FileHandler:
    """Lands a plan's pages in a mapping of its file, checked on the host as they land;
    returns the tokens of the prefix that arrived."""

    checks = "host"

    def check(self, reader: Reader, into: IntoFile, count: int) -> None:
        if not reader.rank.identity:
            raise InvalidInputError("pages land in a file only for a rank of whole pages")
        if into.offset < 0:
            raise InvalidInputError(f"offset must not be negative, got {into.offset}")

    def empty(self, reader: Reader, into: IntoFile) -> int:
        return 0

    async def land(self, reader: Reader, pages: FoundPages, into: IntoFile) -> int:
        page, count = reader.namespace.page_nbytes, pages.count
        end = into.offset + count * page
        with open(into.path, "a+b") as f:
            if os.fstat(f.fileno()).st_size < end:
                f.truncate(end)
        mapped = np.memmap(
            into.path, dtype=np.uint8, mode="r+", offset=into.offset, shape=count * page
        )
        try:
            return await reader.fetch_into(pages, page_spans(mapped, count, page))
        finally:
            mapped.flush()
            del mapped


def file_plan(
    found: StoredPrefix, path: str | os.PathLike[str], start_block: int = 0, offset: int = 0
) -> GetPlan[int]:
    """The pages ``found`` names, blocks ``start_block`` on, into the file at ``path``
    from byte ``offset`` on (see the module docstring)."""
    return GetPlan(found, IntoFile(path, offset), start_block)


register_handler(NODES, IntoFile, FileHandler())
