"""Placement without a master: rendezvous (highest-random-weight) hashing.

Every client ranks the live nodes for a page by blake2b(node id || page hash) and
stores the page on the top ``replicas`` nodes. Adding or removing a node only moves
the pages that ranked it first, and all clients agree without talking to each other."""

from __future__ import annotations

import hashlib


def _score(node_id: str, page_hash: bytes) -> int:
    return int.from_bytes(
        hashlib.blake2b(node_id.encode() + page_hash, digest_size=8).digest(), "little"
    )


def rank_nodes(page_hash: bytes, node_ids: list[str]) -> list[str]:
    """All ``node_ids`` ordered from most to least preferred for ``page_hash``."""
    return sorted(node_ids, key=lambda n: _score(n, page_hash), reverse=True)


def place(page_hash: bytes, node_ids: list[str], replicas: int) -> list[str]:
    """The ``replicas`` distinct nodes (fewer if fewer are live) that should hold the page."""
    return rank_nodes(page_hash, node_ids)[:replicas]
