"""The Redis/Valkey page index: ``records`` (what it holds and answers, as plain
data), ``page_index`` (``PageIndex``/``AsyncPageIndex``), whose methods live by job in
``lookups`` (with ``entry_picks``: which entries answer a lookup), ``publish`` and
``registry`` over ``driver`` (how a method's batches are sent) and ``checks`` (its
arguments), ``scripts`` (the Lua scripts in ``lua/``), ``routing`` (shards and slots)
and ``urls`` (index URLs)."""

from kvstore.index.page_index import AsyncPageIndex, PageIndex
from kvstore.index.records import (
    ENTRY,
    HASH_PAIR,
    CommitEntry,
    IndexLookup,
    IndexStats,
    LookupResult,
    NamespaceStats,
    NodeInfo,
    PageLocation,
    Registration,
    select_records,
)

__all__ = [
    "ENTRY",
    "HASH_PAIR",
    "AsyncPageIndex",
    "CommitEntry",
    "IndexLookup",
    "IndexStats",
    "LookupResult",
    "NamespaceStats",
    "NodeInfo",
    "PageIndex",
    "PageLocation",
    "Registration",
    "select_records",
]
