"""Copying with checksums (kvstore.pages.checksum.copy_checksummed), the same-host path's
one copy: every byte lands and every digest is the page's xxh3, in page order,
whichever thread copied it, however it was chunked, and whether the C loop
(kvstore/pages/_copyhash.c: C-contiguous pieces, or rows of them along the first axis) or
the Python one (other strided pieces) ran. Hashing on two threads
(``checksums``) and ahead of a plan (``HashAhead``): the same digests, in order."""

import itertools
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.pages import checksum
from kvstore.pages.checksum import CHUNK, HashAhead, checksums, copy_checksummed

SIZES = st.sampled_from([1, 4096, 65536, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 12345])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 40),
    st.integers(1, 5000),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_c_loop_copies_a_block_of_every_layer_row_by_row(
    layers, rows, row_bytes, scatter_dst, stream, seed
):
    """A block's slice of every layer (``cache[:, start:end]``: strided across layers,
    contiguous within one) is taken by the C loop as one range per layer, either side:
    every byte lands in page order, nothing else in the cache is written, and the digest
    is the page's whichever side is hashed."""
    rng = np.random.default_rng(seed)
    cache = rng.integers(0, 256, (layers, rows + 7, row_bytes), dtype=np.uint8)
    before = cache.copy()
    block = cache[:, 3 : 3 + rows]  # not C-contiguous when layers > 1
    page = rng.integers(0, 256, block.size, dtype=np.uint8)
    for hash_source in (False, True):
        if scatter_dst:
            pair, expect = (block, page), page
        else:
            pair, expect = (
                (np.zeros(block.size, np.uint8), block),
                np.ascontiguousarray(block).reshape(-1),
            )
        sums = checksum._copy_loop.copy_hash([pair], hash_source, stream)
        assert sums == [xxhash.xxh3_64_intdigest(expect)]
        assert np.array_equal(np.ascontiguousarray(pair[0]).reshape(-1), expect)
    if scatter_dst:
        before[:, 3 : 3 + rows] = page.reshape(block.shape)
    assert np.array_equal(cache, before)  # the rows around the block are untouched


@settings(max_examples=30, deadline=None)
@given(st.lists(SIZES, min_size=0, max_size=12), st.booleans(), st.integers(0, 2**32 - 1))
def test_every_page_lands_with_its_own_checksum(sizes, hash_source, seed):
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    # destinations inside one buffer with gaps, as sinks inside a caller's tensor are
    flat = np.full(sum(sizes) + 7 * len(sizes) + 7, 0xAB, dtype=np.uint8)
    dsts, at = [], 7
    for n in sizes:
        dsts.append(flat[at : at + n])
        at += n + 7
    sums = copy_checksummed(list(zip(dsts, srcs)), hash_source=hash_source)
    assert sums == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d, s)
    gaps = np.ones(flat.size, dtype=bool)
    at = 7
    for n in sizes:
        gaps[at : at + n] = False
        at += n + 7
    assert (flat[gaps] == 0xAB).all()  # nothing written outside the destinations


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 40),
    st.sampled_from([1, 512, 4096, CHUNK // 8]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_scattered_pages_land_and_hash_as_contiguous_ones(
    layers, rows, row_bytes, into_pieces, seed
):
    """A page scattered over a caller's tensors (insert/select: rows of key, then of
    value, with other tokens' rows between them) copies to and from a contiguous slot
    byte for byte, and its digest is the page's, whichever side is scattered."""
    rng = np.random.default_rng(seed)
    key = rng.integers(0, 256, (layers, rows + 3, row_bytes), dtype=np.uint8)
    value = rng.integers(0, 256, (layers, rows + 3, row_bytes), dtype=np.uint8)
    pieces = (
        key[:, 1 : 1 + rows],
        value[:, 1 : 1 + rows],
    )  # strided: 2 rows of other tokens around them
    page = np.concatenate([p.reshape(-1) for p in pieces])
    pairs_of_pages = 3  # several pairs, so both threads copy
    if into_pieces:
        before_key, before_value = key.copy(), value.copy()
        key[:, 1 : 1 + rows] = 0
        value[:, 1 : 1 + rows] = 0
        sums = copy_checksummed(
            [(pieces, page)] + [(np.empty_like(page), page) for _ in range(pairs_of_pages - 1)]
        )
        assert np.array_equal(key, before_key) and np.array_equal(
            value, before_value
        )  # every row back, nothing else touched
    else:
        slots = [np.zeros_like(page) for _ in range(pairs_of_pages)]
        sums = copy_checksummed(
            [(slots[0], pieces)] + [(s, page) for s in slots[1:]], hash_source=True
        )
        assert all(np.array_equal(s, page) for s in slots)
    assert sums == [xxhash.xxh3_64_intdigest(page)] * pairs_of_pages


@settings(max_examples=24, deadline=None)
@given(
    st.sampled_from(list(itertools.permutations(range(4)))),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_pages_scattered_over_any_memory_order_copy_exactly(order, into_pieces, seed):
    """A paged cache's blocks under every order of (blocks, heads, tokens, bytes) in memory
    (vLLM's layouts and more): each block of each layer is one piece, contiguous or not,
    and the copy walks it in the piece's own C order."""
    rng = np.random.default_rng(seed)
    blocks, heads, tokens, row = 5, 3, 4, 8
    layers = []
    for _ in range(2):
        physical = rng.integers(
            0, 256, tuple((blocks, heads, tokens, row)[k] for k in order), dtype=np.uint8
        )
        layers.append(physical.transpose(np.argsort(order)))  # logical [blocks, heads, tokens, row]
    chosen = [3, 0, 4]
    pages = [np.concatenate([layer[b].reshape(-1) for layer in layers]) for b in chosen]
    if into_pieces:
        before = [layer.copy() for layer in layers]
        for layer in layers:
            layer[chosen] = 0
        sums = copy_checksummed(
            [(tuple(layer[b] for layer in layers), page) for b, page in zip(chosen, pages)]
        )
        assert all(np.array_equal(layer, was) for layer, was in zip(layers, before))
    else:
        slots = [np.zeros_like(page) for page in pages]
        sums = copy_checksummed(
            [(slot, tuple(layer[b] for layer in layers)) for slot, b in zip(slots, chosen)],
            hash_source=True,
        )
        assert all(np.array_equal(slot, page) for slot, page in zip(slots, pages))
    assert sums == [xxhash.xxh3_64_intdigest(page) for page in pages]


def _cut(buf: np.ndarray, cuts: list[int]) -> tuple[np.ndarray, ...]:
    """``buf`` as pieces split at ``cuts`` (some empty when cuts repeat)."""
    bounds = [0, *sorted(c % (buf.size + 1) for c in cuts), buf.size]
    return tuple(buf[a:b] for a, b in zip(bounds, bounds[1:]))


def test_this_build_copies_in_c():
    """CI must exercise the C loop: it is bound (xxhash exports its XXH3 functions)."""
    assert checksum._copy_loop is not None


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300_000),
    st.lists(st.integers(0, 300_000), max_size=5),
    st.lists(st.integers(0, 300_000), max_size=5),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_c_loop_copies_any_cut_of_a_page_and_hashes_the_page(
    size, dst_cuts, src_cuts, hash_source, stream, seed
):
    """Pages cut into contiguous pieces anywhere on either side (lengths that are not
    multiples of the loop's 64 KiB or of 16-byte stores, unaligned addresses): every
    byte lands, nothing around the destination is written, and each digest is xxhash's
    of the page, with streaming stores or without."""
    rng = np.random.default_rng(seed)
    page = rng.integers(0, 256, size, dtype=np.uint8)
    into = np.full(size + 2 * 13, 0xAB, dtype=np.uint8)
    dst = into[13 : 13 + size]  # an odd address
    flat_out = np.zeros(size, dtype=np.uint8)
    pairs = [
        (_cut(dst, dst_cuts), page),
        (flat_out, _cut(page.copy(), src_cuts)),
        (np.zeros(size, np.uint8), page),
    ]
    sums = checksum._copy_loop.copy_hash(pairs, hash_source, stream)
    assert sums == [xxhash.xxh3_64_intdigest(page)] * 3
    assert (
        np.array_equal(dst, page)
        and np.array_equal(flat_out, page)
        and np.array_equal(pairs[2][0], page)
    )
    assert (into[:13] == 0xAB).all() and (into[13 + size :] == 0xAB).all()


def test_the_c_loop_leaves_strided_pieces_to_python_untouched_and_names_a_size_mismatch():
    src = np.arange(64, dtype=np.uint8)
    strided = np.zeros(128, dtype=np.uint8)[::2]  # a piece of a cache whose blocks are strided
    contiguous = np.zeros(64, dtype=np.uint8)
    assert (
        checksum._copy_loop.copy_hash([(contiguous, src), ((strided,), src)], False, False) is None
    )
    assert not contiguous.any() and not strided.any()  # nothing copied before it gave up
    assert (
        copy_checksummed([(contiguous, src), ((strided,), src)])
        == [xxhash.xxh3_64_intdigest(src)] * 2
    )  # the Python loop
    assert np.array_equal(strided, src)
    with pytest.raises(ValueError, match="pair 1: destination and source differ in size"):
        checksum._copy_loop.copy_hash(
            [(contiguous, src), (np.zeros(63, np.uint8), src)], False, False
        )


@settings(max_examples=30, deadline=None)
@given(st.lists(SIZES, min_size=0, max_size=12), st.integers(0, 2**32 - 1))
def test_checksums_on_two_threads_are_each_pages_own_in_order(sizes, seed):
    rng = np.random.default_rng(seed)
    pages = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    assert checksums(pages) == [xxhash.xxh3_64_intdigest(p) for p in pages]


def test_hash_ahead_records_pages_in_order_and_stops_after_the_page_it_is_on():
    rng = np.random.default_rng(5)
    pages = [rng.integers(0, 256, 4 * CHUNK, dtype=np.uint8) for _ in range(16)]
    expected = {k: xxhash.xxh3_64_intdigest(p) for k, p in enumerate(pages)}
    got: dict[int, int] = {}
    on_first, release = threading.Event(), threading.Event()

    def record(k: int, digest: int) -> None:
        got[k] = digest
        if k == 0:  # hold the helper on page 0 until stop has been asked for
            on_first.set()
            release.wait(10)

    ahead = HashAhead(pages, record)
    assert on_first.wait(10)
    threading.Timer(0.2, release.set).start()
    ahead.stop()  # asks, then waits for the helper, which is released 0.2 s later
    assert got == {0: expected[0]}
    got.clear()
    ahead = HashAhead(pages, got.__setitem__)
    ahead._future.result()  # left to run: every page, in order
    ahead.stop()
    assert got == expected
