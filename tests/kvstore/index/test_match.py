"""Which index entries answer a lookup, and which are live (``kvstore/index/_match.c``,
through ``lookups._pick`` and ``IndexLookup.resolve``/``present``), against a plain
Python reading of the rules: an entry counts at the position its segment and pos field
name when its hash is one of the unit hashes asked there (``heads.unit_hashes``, the
keys transfers store), and a position is held when a live incarnation holds every unit
asked there."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.index.entry_picks import pick as _pick
from kvstore.index.records import ENTRY, IndexLookup, NodeInfo, live_records
from kvstore.pages import keys
from kvstore.pages.heads import unit_hashes

TAGS = (0xAAAA0001, 0xBBBB0002, 0xCCCC0003)


def _entry(key: bytes, pos: int, node: int, tag: int, slot: int) -> bytes:
    rec = np.zeros(1, dtype=ENTRY)
    rec["h0"], rec["h1"] = np.frombuffer(key, dtype="<u8")
    rec["pos"], rec["node"], rec["tag"], rec["slot"] = pos, node, tag, slot
    return rec.tobytes()


@st.composite
def _lookups(draw: st.DrawFn) -> dict:
    """A lookup's asked hashes, its segments (chains from breaks, any span, an offset)
    and replies: some segments read, in parts as shards return them, with entries of
    asked units, other units, other blocks and positions outside their segment."""
    n = draw(st.integers(1, 14))
    blob = os.urandom(16 * n)
    span = draw(st.integers(1, 6))
    breaks = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    offset = draw(st.integers(0, span - 1)) if span > 1 and not breaks else 0
    segs = keys.segments(n, breaks, span, offset)
    contiguous = draw(st.integers(0, len(segs)))
    if draw(st.booleans()):
        first: int | np.ndarray = draw(st.integers(0, 2))
        need: int | np.ndarray = draw(st.integers(1, 3))
    else:
        first = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
        need = np.array(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    read = [j for j in range(len(segs)) if draw(st.booleans()) or j < contiguous]
    order = draw(st.permutations(read))
    parts = []
    slot = 0
    while order:
        size = draw(st.integers(1, len(order)))
        done, order = sorted(order[:size]), order[size:]
        counts, joined = [], b""
        for j in done:
            start, end = segs[j]
            shift = offset if j == 0 else 0
            entries = draw(st.integers(0, 4))
            for _ in range(entries):
                p = draw(st.integers(-shift, end - start + 1))
                at = blob[16 * min(max(start + p, 0), n - 1) :][:16]
                unit = draw(st.integers(0, 4))
                key = unit_hashes([at], unit, 1)[0]
                if draw(st.integers(0, 5)) == 0:  # another block's page
                    key = bytes([key[0] ^ 1]) + key[1:]
                node, tag = draw(st.integers(0, 4)), draw(st.sampled_from(TAGS))
                joined += _entry(key, p + shift, node, tag, slot)
                slot += 1
            counts.append(entries)
        parts.append((done, counts, joined))
    return dict(
        blob=blob, segs=segs, parts=parts, contiguous=contiguous, first=first, need=need,
        offset=offset,
    )  # fmt: skip


def _per_position(value: int | np.ndarray, n: int) -> list[int]:
    return [value] * n if isinstance(value, int) else [int(v) for v in value]


def _reference_pick(case: dict) -> tuple[int, list[tuple[bytes, int, int]]]:
    """Covered positions and the counted (entry, position, unit), in reply order."""
    blob, segs, contiguous = case["blob"], case["segs"], case["contiguous"]
    n = len(blob) // 16
    if contiguous == 0 or not case["parts"]:
        return 0, []
    firsts, needs = _per_position(case["first"], n), _per_position(case["need"], n)
    out = []
    for done, counts, joined in case["parts"]:
        entries = [joined[48 * i : 48 * i + 48] for i in range(len(joined) // 48)]
        for j, count in zip(done, counts):
            mine, entries = entries[:count], entries[count:]
            start, end = segs[j]
            for entry in mine:
                p = int(np.frombuffer(entry, dtype=ENTRY)["pos"][0])
                p -= case["offset"] if j == 0 else 0
                if j >= contiguous or not 0 <= p < end - start:
                    continue
                position = start + p
                asked = unit_hashes(
                    [blob[16 * position : 16 * position + 16]],
                    firsts[position],
                    needs[position],
                )
                if entry[:16] in asked:
                    out.append((entry, position, asked.index(entry[:16])))
    return segs[contiguous - 1][1], out


@settings(max_examples=300, deadline=None)
@given(_lookups())
def test_picked_entries_are_the_asked_units_at_their_positions(case):
    """``_pick`` keeps exactly the entries the rules count, in the order read, with their
    positions and units (counted from the first unit asked there): over chains from
    breaks, segments of any span, a chain asked from the middle of its first segment,
    segments read past the prefix's end, and units asked per position or for all."""
    got = _pick(
        case["blob"], case["segs"], case["parts"], case["contiguous"], None,
        case["first"], case["need"], case["offset"],
    )  # fmt: skip
    covered, want = _reference_pick(case)
    assert got.covered == covered
    assert [
        (got.records[i : i + 1].tobytes(), int(got.positions[i]), int(got.units[i]))
        for i in range(len(got.records))
    ] == want
    n = len(case["blob"]) // 16
    want_need = case["need"] if isinstance(case["need"], int) else case["need"][:covered].tolist()
    assert (got.need if isinstance(got.need, int) else got.need.tolist()) == want_need
    assert n >= covered


def _nodes(draw: st.DrawFn) -> list[NodeInfo]:
    numbers = draw(st.sets(st.integers(0, 5), max_size=4))
    return [
        NodeInfo(f"n{k}", f"h:{k}", 1, "0" * 24 + f"{draw(st.sampled_from(TAGS)):08x}", k)
        for k in sorted(numbers)
    ]


@settings(max_examples=300, deadline=None)
@given(_lookups(), st.data(), st.booleans())
def test_resolved_prefix_holds_every_asked_unit_on_a_live_incarnation(case, data, last):
    """``resolve`` ends the prefix at the first position where some asked unit has no
    entry of a live incarnation (``last``: after the last position where all have one)
    and keeps the live entries before it (of that position); ``present`` says per
    position whether all are there; ``live_records`` which entries are live."""
    found = _pick(
        case["blob"], case["segs"], case["parts"], case["contiguous"], None,
        case["first"], case["need"], case["offset"],
    )  # fmt: skip
    nodes = _nodes(data.draw)
    live = {node.number: node.tag for node in nodes}
    ok = [
        live.get(int(rec["node"])) == int(rec["tag"]) for rec in found.records
    ]  # a tag of 32 bits
    needs = _per_position(found.need, found.covered)
    held = [
        {int(u) for u, p, k in zip(found.units, found.positions, ok) if k and p == position}
        == set(range(needs[position]))
        for position in range(found.covered)
    ]
    if last:
        matched = max((p + 1 for p, h in enumerate(held) if h), default=0)
        keep = [k and p == matched - 1 for p, k in zip(found.positions, ok)]
    else:
        matched = held.index(False) if False in held else found.covered
        keep = [k and p < matched for p, k in zip(found.positions, ok)]
    result = found.resolve(nodes, last=last)
    assert result.matched == matched
    assert result._records.tobytes() == b"".join(
        found.records[i : i + 1].tobytes() for i, k in enumerate(keep) if k
    )
    assert result._positions.tolist() == [int(p) for p, k in zip(found.positions, keep) if k]
    assert result._units.tolist() == [int(u) for u, k in zip(found.units, keep) if k]
    assert found.present(nodes).tolist() == held
    assert live_records(found.records, {n.number: n for n in nodes}).tolist() == ok


def test_malformed_entries_and_mismatched_arrays_are_refused_by_name():
    """Bad input to the C pass is a clear error naming what was wrong, never a read past
    a buffer: a reply of no whole entries, counts that do not add up, arrays of
    different lengths, per-position values short of the positions."""
    from array import array

    from kvstore.index import _match

    blob = os.urandom(32)
    rec = _entry(blob[:16], 0, 1, TAGS[0], 0)
    with pytest.raises(ValueError, match="recs: 47 bytes is not a whole number of 48-byte"):
        _match.pick(blob, rec[:47], array("q", [1, 0, 2, 0]), 0, 1, None, None)
    with pytest.raises(ValueError, match="runs count 2 entries, recs holds 1"):
        _match.pick(blob, rec, array("q", [2, 0, 2, 0]), 0, 1, None, None)
    with pytest.raises(ValueError, match="needs: 1 values for 2 positions"):
        _match.pick(blob, rec, array("q", [1, 0, 2, 0]), 0, 0, array("q", [0, 0]), array("q", [1]))
    positions = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="1 records, 2 positions and 1 units"):
        _match.resolve(rec, positions, np.zeros(1, dtype=np.int64), [-1], 2, 1, None, False)
    with pytest.raises(TypeError, match="tags must be a sequence of ints"):
        _match.live(rec, 5)
    found = IndexLookup(2, np.frombuffer(rec, dtype=ENTRY), positions[:1], positions[:1], 1)
    node = NodeInfo("x", "h:1", 1, "0" * 24 + f"{TAGS[0]:08x}", 1)
    assert found.resolve([node]).matched == 1  # position 1 holds nothing
    assert found.present([node]).tolist() == [True, False]
