"""The entries of a lookup's asked pages out of the index segments it read: which
entries count (the asked head-group units of the asked hash at each position, in the
segments before the first missing one) and the ``IndexLookup`` they make.

Called by ``kvstore.index.lookups.LookupMethods.lookup``: ``pick`` for the segments the
lookup script or plain GETs read, ``pick_pages`` for one-page segments read by one MGET,
``picked`` for a lookup that read nothing. Pure functions of the bytes read (one pass in
C, ``_match.pick``): no index call, no state, so the same replies always give the same
entries, and both read paths keep exactly the same ones."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.index import _match
from kvstore.index.records import ENTRY, IndexLookup, entry_arrays

_NO_RECORDS = np.zeros(0, dtype=ENTRY)
_NO_NUMBERS = np.zeros(0, dtype=np.int64)


def pick(
    blob: bytes,
    segs: list[tuple[int, int]],
    parts: list[tuple[list[int], list[int], bytes]],
    contiguous: int,
    unavailable: KVStoreError | None,
    first: np.ndarray | int,
    need: np.ndarray | int,
    offset: int = 0,
) -> IndexLookup:
    """The entries of the asked pages out of the segments read (``parts``: per reply,
    the segments it read, their entry counts and the entries). Only the first
    ``contiguous`` segments count (the prefix ends at the first missing one), and an
    entry counts when it is a unit in ``[first, first + need)`` (per position) of the
    hash asked at its position (kvstore.pages.heads; whole pages are unit 0 of themselves):
    other chains that share the segment's anchor hold the rest. ``first`` and ``need``:
    per position, or one number for every position (a lookup of one chain). ``offset``:
    the first segment's records of the asked hashes start at that position."""
    if contiguous == 0 or not parts:
        return picked(blob, b"", [], 0, first, need, unavailable)
    runs: list[int] = []
    for done, counts, _ in parts:
        for j, count in zip(done, counts):
            start, end = segs[j]
            runs += (count, start if j < contiguous else -1, end - start, offset if j == 0 else 0)
    recs = parts[0][2] if len(parts) == 1 else b"".join(part[2] for part in parts)
    return picked(blob, recs, runs, segs[contiguous - 1][1], first, need, unavailable)


def pick_pages(
    blob: bytes, values: list[Any], first: int, need: int, sparse: bool = False
) -> IndexLookup:
    """``pick`` for hashes that are each a one-page segment (``values``: the segments'
    values in order, None where there is none): the prefix ends at the first missing
    segment (``sparse``: none ends it, every position is covered), and an entry counts
    when it is the page at its segment's head (position 0) and a unit in ``[first,
    first + need)`` of the hash asked there (``pick``)."""
    if sparse:
        covered = len(values)
    else:
        covered = next((i for i, value in enumerate(values) if value is None), len(values))
    runs: list[int] = []
    read: list[bytes] = []
    for i in range(covered):
        if value := values[i]:
            runs += (len(value) // ENTRY.itemsize, i, 1, 0)
            read.append(value)
    return picked(blob, b"".join(read), runs, covered, first, need)


def picked(
    blob: bytes,
    recs: bytes,
    runs: list[int],
    covered: int,
    first: np.ndarray | int,
    need: np.ndarray | int,
    unavailable: KVStoreError | None = None,
) -> IndexLookup:
    """The ``IndexLookup`` of entries ``recs`` read in ``runs`` (``_match.pick``: per
    segment read, its entry count, first position, length and shift): one pass in C,
    where about 30 numpy calls took 0.11 ms of a first lookup after 1 s of quiet (cold
    caches: the scheduler asks after pauses), against 0.03 warm (docs/benchmarks.md)."""
    if not runs:
        none = need if isinstance(need, int) else need[:0]
        return IndexLookup(covered, _NO_RECORDS, _NO_NUMBERS, _NO_NUMBERS, none, unavailable)
    if isinstance(first, int) and isinstance(need, int):
        kept, positions, units = _match.pick(blob, recs, array("q", runs), first, need, None, None)
        kept_need: np.ndarray | int = need
    else:
        firsts = np.ascontiguousarray(first, dtype=np.int64)
        needs = np.ascontiguousarray(need, dtype=np.int64)
        kept, positions, units = _match.pick(blob, recs, array("q", runs), 0, 0, firsts, needs)
        kept_need = needs[:covered]
    return IndexLookup(covered, *entry_arrays(kept, positions, units), kept_need, unavailable)
