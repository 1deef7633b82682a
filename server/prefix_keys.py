"""A prefix's page keys on a node, for the queries that name a prefix by its tokens or
its block hashes (server/query.py, server/control/).

The node keys a page by its namespace's digest and its unit hash (server/page.py): a
block of a namespace with head or layer groups is several units, every one keyed by
the block's chain hash with its unit number mixed in (kvstore.pages.heads)."""

from __future__ import annotations

import numpy as np

from kvstore.pages.hashing import HASH_BYTES, block_hash_bytes
from kvstore.pages.heads import rank_units, unit_hashes
from kvstore.pages.identity import NO_EXTRAS, RequestIdentity
from kvstore.pages.namespace import Namespace
from server.page import PageKey


def prefix_chain(ns: Namespace, tokens: np.ndarray, identity: RequestIdentity) -> bytes:
    """The block hashes of ``tokens`` in ``ns`` (whole blocks only), joined, as a client
    with ``identity`` hashes them."""
    extras = NO_EXTRAS if identity.empty else identity.block_extras(ns.block_size, len(tokens))
    return block_hash_bytes(ns, tokens, extras)


def block_keys(ns: Namespace, joined: bytes) -> list[list[PageKey]]:
    """Per block of the joined chain hashes, the keys of its every unit on a node."""
    chain = [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
    count = rank_units(ns).count
    keys = unit_hashes(chain, 0, count) if count > 1 else chain
    n = len(chain)
    # unit_hashes lists every block's unit 0, then every block's unit 1, ...
    return [[(ns.digest_hex, keys[u * n + b]) for u in range(count)] for b in range(n)]
