"""The Redis/Valkey page index: ``records`` (what it holds and answers, as plain
data), ``page_index`` (``PageIndex``/``AsyncPageIndex`` and their Lua scripts in
``lua/``), ``routing`` (URLs, shards and slots)."""

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
