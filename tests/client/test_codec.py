"""Page and tail codecs (pure logic): round trips for any geometry."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client import codec
from kvstore import Namespace
from kvstore.pages.checksum import copy_checksummed
from tests.support.helpers import pages_to_kv


def make_ns(layers, heads, head, block, hidden):
    return Namespace(
        model="codec",
        dtype="float16",
        num_layers=layers,
        num_kv_heads=heads,
        head_size=head,
        block_size=block,
        hidden_size=hidden,
    )


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    head=st.integers(1, 8),
    block=st.integers(1, 6),
    tokens=st.integers(0, 30),
    hidden=st.integers(0, 5),
    with_hidden=st.booleans(),
)
def test_pages_and_tail_round_trip(layers, heads, head, block, tokens, hidden, with_hidden):
    ns = make_ns(layers, heads, head, block, hidden)
    g = torch.Generator().manual_seed(tokens)
    key = torch.randn(layers, tokens, heads, head, generator=g).half()
    value = torch.randn(layers, tokens, heads, head, generator=g).half()
    hid = torch.randn(tokens, hidden, generator=g).half() if with_hidden else None
    full = tokens // block
    # a page is [2, layers, block, heads, head]: block b's key rows, then its value rows
    pages = (
        torch.stack([key[:, : full * block], value[:, : full * block]])
        .unflatten(2, (full, block))
        .permute(2, 0, 1, 3, 4, 5)
        .contiguous()
    )
    for count in [
        c for c in (1, 2, 3) if heads % c == 0
    ]:  # the spans of each head group's units, unit by unit
        spans = codec.kv_spans(ns, key, value, full, count)
        assert len(spans) == full * count
        g = heads // count
        for j in range(count):
            for b in range(full):
                got = np.empty(spans[j * full + b].nbytes, dtype=np.uint8)
                copy_checksummed([(got, spans[j * full + b].bytes())])
                assert np.array_equal(
                    got,
                    pages[b, :, :, :, j * g : (j + 1) * g]
                    .contiguous()
                    .view(torch.uint8)
                    .reshape(-1)
                    .numpy(),
                )
    k, v = pages_to_kv(pages)
    assert torch.equal(k, key[:, : full * block]) and torch.equal(v, value[:, : full * block])
    blob = codec.encode_tail(ns, key, value, hid)
    sizes = codec.tail_part_sizes(ns, tokens, hid is not None)
    assert sum(sizes) == blob.nbytes == codec.tail_nbytes(ns, tokens, hid is not None)
    assert all(0 < s <= codec.TAIL_PART_BYTES for s in sizes)
    assert codec.read_tail_flags(blob) == (tokens, hid is not None)
    tail = codec.decode_tail(ns, blob)
    assert torch.equal(tail.partial_key, key[:, full * block :]) and torch.equal(
        tail.partial_value, value[:, full * block :]
    )
    assert (tail.hidden is None) == (hid is None)
    if hid is not None:
        assert torch.equal(tail.hidden, hid)


def test_large_tails_split_into_parts():
    ns = make_ns(1, 1, 8, 16, 4096)
    sizes = codec.tail_part_sizes(ns, 1000, True)
    assert len(sizes) == 2 and sizes[0] == codec.TAIL_PART_BYTES


def test_foreign_bytes_are_not_a_tail_header():
    assert codec.read_tail_flags(np.zeros(64, dtype=np.uint8)) is None
    assert codec.read_tail_flags(np.zeros(3, dtype=np.uint8)) is None
