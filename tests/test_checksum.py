"""Copying with checksums (kvstore.pages.checksum.copy_checksummed), the same-host path's
one copy: every byte lands and every digest is the page's xxh3, in page order,
whichever thread copied it and however it was chunked."""

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.pages.checksum import CHUNK, copy_checksummed

SIZES = st.sampled_from([1, 4096, 65536, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 12345])


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
