"""A medium added as one module (``client.gets.file_handler``): pages land in a file
through the handler it registers, read by the client's ``read``, over shared memory and
over UCX, bit-exact from ``start_block`` on at the file's ``offset``; a corrupted page
ends the prefix; a plan into a destination no handler takes is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from client import KVCacheClient
from client.gets.file_handler import IntoFile, file_plan
from client.gets.handlers import NODES, handler_for, register_handler
from client.gets.plan import Destination, GetPlan
from kvstore import InvalidInputError, block_hashes
from tests.support.client_fixtures import BLOCK, make_ns
from tests.support.helpers import corrupt_entry_checksums, pages_for


def _page_bytes(pages, first: int, last: int) -> bytes:
    return pages[first:last].contiguous().view(-1).numpy().view(np.uint8).tobytes()


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_pages_land_in_a_file_bit_exact(clusters, same_host, tmp_path):
    store = clusters()
    ns = make_ns(f"file-{same_host}")
    tokens = list(range(6 * BLOCK))
    pages = pages_for(ns, tokens)
    path = tmp_path / "prefix.kv"
    path.write_bytes(b"\xee" * 100)  # a header the get must leave alone
    with KVCacheClient(store.redis_url, ns, timeout=10, same_host=same_host) as client:
        assert client.put_pages(tokens, pages).stored == 6
        found = client.find(tokens)
        assert client.read(file_plan(found, path, start_block=2, offset=100)) == len(tokens)
        data = path.read_bytes()
        assert data[:100] == b"\xee" * 100
        assert data[100:] == _page_bytes(pages, 2, 6)
        assert client.stats.checksum_failures == 0
        # nothing to fetch past the prefix: 0, the file untouched
        assert client.read(file_plan(found, tmp_path / "none.kv", start_block=6)) == 0
        assert not (tmp_path / "none.kv").exists()


def test_a_corrupt_page_ends_the_prefix_in_the_file(clusters, tmp_path):
    store = clusters()
    ns = make_ns("file-corrupt")
    tokens = list(range(5 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(store.redis_url, ns, timeout=10) as client:
        client.put_pages(tokens, pages)
        assert corrupt_entry_checksums(store.redis_url, ns, block_hashes(ns, tokens), 3)
        path = tmp_path / "prefix.kv"
        got = client.read(file_plan(client.find(tokens), path))
        assert got == 3 * BLOCK
        assert path.read_bytes()[: 3 * ns.page_nbytes] == _page_bytes(pages, 0, 3)
        assert client.stats.checksum_failures >= 1


def test_the_handler_is_registered_and_a_destination_without_one_is_refused(clusters):
    store = clusters()
    assert type(handler_for(NODES, IntoFile)).__name__ == "FileHandler"
    with pytest.raises(ValueError, match="registered"):
        register_handler(NODES, IntoFile, handler_for(NODES, IntoFile))

    @dataclass(frozen=True)
    class Nowhere(Destination[int]):
        pass

    ns = make_ns("file-nowhere")
    tokens = list(range(2 * BLOCK))
    with KVCacheClient(store.redis_url, ns, timeout=10) as client:
        client.put_pages(tokens, pages_for(ns, tokens))
        with pytest.raises(InvalidInputError, match="nodes into Nowhere"):
            client.read(GetPlan(client.find(tokens), Nowhere()))
