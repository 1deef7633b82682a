"""kvstore as SGLang's HiCache L3 storage backend: ``KVStoreHiCache``, which SGLang
loads with ``--hicache-storage-backend dynamic`` (docs/sglang.md). The class is
imported on first use, since it subclasses SGLang's own; the options, page mapping
and pool calls (``client.sglang.options``, ``client.sglang.pool_pages``,
``client.sglang.pool_calls``) import nothing of SGLang."""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreHiCache"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreHiCache":
        from client.sglang.backend import KVStoreHiCache

        return KVStoreHiCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
