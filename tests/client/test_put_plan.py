"""A put is a plan (``client.puts.plan``): the public puts of both clients are views of
one builder each (one signature, written once), every put runs through the handler
registered for its (source kind, nodes) pair in the registry gets use too, and a plan
may pair keys and sources no public method pairs (a prompt's blocks from spans)."""

from __future__ import annotations

import inspect

import pytest

from client import AsyncKVCacheClient, KVCacheClient
from client.gets.handlers import NODES, handler_for, registered
from client.gets.plan import IntoPages
from client.memory.buffers import host_bytes, page_spans
from client.puts.plan import (
    Blocks,
    FromPages,
    FromSpans,
    PutPlan,
    keyed_put_plan,
    pages_put_plan,
)
from kvstore import InvalidInputError
from tests.support.client_fixtures import BLOCK, make_ns, single_index_cluster  # noqa: F401
from tests.support.helpers import pages_for


@pytest.mark.parametrize("client_class", [AsyncKVCacheClient, KVCacheClient])
@pytest.mark.parametrize(
    "method,build", [("put_pages", pages_put_plan), ("put_keyed", keyed_put_plan)]
)
def test_each_put_is_a_view_of_its_plan_builder(client_class, method, build):
    view = getattr(client_class, method)
    built = inspect.signature(build)
    assert list(inspect.signature(view).parameters)[1:] == list(built.parameters)
    assert [p.kind for p in inspect.signature(view).parameters.values()][1:] == [
        p.kind for p in built.parameters.values()
    ]
    assert view.__doc__ == build.__doc__


def test_gets_and_puts_share_one_registry():
    pairs = registered()
    assert {(FromPages, NODES), (FromSpans, NODES), (NODES, IntoPages)} <= set(pairs)
    assert type(handler_for(FromSpans, NODES)).__name__ == "SpansSource"
    assert type(handler_for(NODES, IntoPages)).__name__ == "PagesHandler"


@pytest.mark.process
def test_a_prompts_blocks_put_from_spans_read_back_bit_exact(single_index_cluster):  # noqa: F811
    ns = make_ns("put-plan-spans")
    tokens = list(range(5 * BLOCK))
    pages = pages_for(ns, tokens)
    spans = page_spans(host_bytes(pages), 5, ns.page_nbytes)
    with KVCacheClient(single_index_cluster.redis_url, ns, timeout=10) as client:
        with pytest.raises(InvalidInputError, match="4 pages for 5 keys"):
            client.put(PutPlan(Blocks(tokens), FromSpans(spans[:4])))
        short = page_spans(host_bytes(pages), 5, ns.page_nbytes - 2)
        with pytest.raises(InvalidInputError, match="a page of this namespace is"):
            client.put(PutPlan(Blocks(tokens), FromSpans(short)))
        assert client.stats.pages_sent == 0
        report = client.put(PutPlan(Blocks(tokens, start_block=1), FromSpans(spans[1:])))
        assert (report.stored, report.sent) == (4, 4)
        assert client.put_pages(tokens[:BLOCK], pages[:1]).stored == 1
        out = pages.clone().zero_()
        assert client.get_pages(tokens, out) == len(tokens)
        assert host_bytes(out).tobytes() == host_bytes(pages).tobytes()
