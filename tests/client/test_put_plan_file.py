"""A put source added as one module (``client.puts.file_source``): pages read from a
file through the handler it registers, put by the client's ``put``, over shared memory
and over UCX, stored bit-exact from ``start_block`` on from the file's ``offset``; a
file too short for its pages is refused before anything is stored; a plan from a source
no handler takes is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from client import KVCacheClient
from client.gets.file_handler import file_plan
from client.gets.handlers import NODES, handler_for, register_handler
from client.puts.file_source import FromFile, file_put_plan
from client.puts.plan import Blocks, PutPlan, Source
from kvstore import InvalidInputError
from tests.support.client_fixtures import BLOCK, make_ns, single_index_cluster  # noqa: F401
from tests.support.helpers import pages_for

pytestmark = pytest.mark.process


def _page_bytes(pages: torch.Tensor, first: int, last: int) -> bytes:
    return pages[first:last].contiguous().view(-1).numpy().view(np.uint8).tobytes()


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_pages_are_put_from_a_file_bit_exact(single_index_cluster, same_host, tmp_path):  # noqa: F811
    ns = make_ns(f"put-file-{same_host}")
    tokens = list(range(6 * BLOCK))
    pages = pages_for(ns, tokens)
    source = tmp_path / "prefix.kv"
    source.write_bytes(b"\xee" * 100 + _page_bytes(pages, 0, 6))
    url = single_index_cluster.redis_url
    with KVCacheClient(url, ns, timeout=10, same_host=same_host) as client:
        # blocks 2 on first (the caller has no pages below them): found only once 0-1 are
        skip = 100 + 2 * ns.page_nbytes
        report = client.put(file_put_plan(tokens, source, start_block=2, offset=skip))
        assert (report.stored, report.sent) == (4, 4)
        assert client.lookup(tokens) == 0
        report = client.put(file_put_plan(tokens, source, offset=100))
        assert (report.stored, report.sent, report.skipped) == (6, 2, 4)
        out = torch.zeros_like(pages)
        assert client.get_pages(tokens, out) == len(tokens)
        assert _page_bytes(out, 0, 6) == _page_bytes(pages, 0, 6)
        # and back into a file (client.gets.file_handler): the same bytes
        landed = tmp_path / "landed.kv"
        assert client.read(file_plan(client.find(tokens), landed)) == len(tokens)
        assert landed.read_bytes() == _page_bytes(pages, 0, 6)
        assert client.stats.checksum_failures == 0


def test_a_file_too_short_is_refused_before_anything_is_stored(single_index_cluster, tmp_path):  # noqa: F811
    ns = make_ns("put-file-short")
    tokens = list(range(3 * BLOCK))
    source = tmp_path / "short.kv"
    source.write_bytes(_page_bytes(pages_for(ns, tokens), 0, 3)[:-1])
    with KVCacheClient(single_index_cluster.redis_url, ns, timeout=10) as client:
        with pytest.raises(InvalidInputError, match="3 pages from byte 0 need"):
            client.put(file_put_plan(tokens, source))
        with pytest.raises(InvalidInputError, match="offset must not be negative"):
            client.put(file_put_plan(tokens, source, offset=-1))
        assert client.lookup(tokens) == 0
        assert client.stats.pages_sent == 0


def test_the_source_is_registered_and_a_source_without_one_is_refused(single_index_cluster):  # noqa: F811
    assert type(handler_for(FromFile, NODES)).__name__ == "FileSource"
    with pytest.raises(ValueError, match="registered"):
        register_handler(FromFile, NODES, handler_for(FromFile, NODES))

    @dataclass(frozen=True)
    class Nowhere(Source):
        pass

    ns = make_ns("put-file-nowhere")
    tokens = list(range(2 * BLOCK))
    with KVCacheClient(single_index_cluster.redis_url, ns, timeout=10) as client:
        with pytest.raises(InvalidInputError, match="from Nowhere to nodes"):
            client.put(PutPlan(Blocks(tokens), Nowhere()))
        assert client.stats.pages_sent == 0
