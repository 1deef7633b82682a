"""The client library against real storage nodes: insert/select, paged API, placement,
replicas, faults. Cross-process cases run the other side in tests/support/worker.py."""

from __future__ import annotations

import pytest
import torch

from client import KVCacheClient
from client.gets.plan import GetPlan, IntoPages, Prompt, SequencePages
from client.gets.sequence_handler import IntoSequence
from kvstore import InvalidInputError, Namespace, block_hashes
from kvstore.index import PageIndex
from tests.support.client_fixtures import BLOCK, client, cluster, insert, ns, same, select  # noqa: F401 (fixtures)
from tests.support.helpers import corrupt_entry_checksums, kv_for, pages_for, run_worker


def test_insert_in_one_process_select_in_another(cluster, ns):
    spec = {"redis_url": cluster.redis_url, "namespace": ns.model_dump(), "count": 10 * BLOCK + 5}
    inserted = run_worker({**spec, "op": "insert"})
    assert inserted["report"]["refused"] == 0 and inserted["report"]["sent"] >= 11
    got = run_worker({**spec, "op": "select"})
    assert got == {**got, "matched": 10 * BLOCK + 5, "exact": True, "hidden": True}
    nodes_used = {n.node_id for n in PageIndex(cluster.redis_url).live_nodes()}
    assert nodes_used == {"node-0", "node-1"}


def test_exact_sequence_returns_everything_and_hidden(client):
    tokens = list(range(3 * BLOCK + 7))
    _, (key, value, hidden) = insert(client, tokens)
    out_tokens, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == len(tokens) and roi.all()
    assert same(k, key) and same(v, value) and same(h, hidden)
    assert out_tokens.tolist() == tokens


def test_shared_prefix_with_diverging_tail_returns_block_aligned_prefix(client):
    tokens = list(range(5 * BLOCK + 3))
    _, (key, value, _) = insert(client, tokens)
    other = tokens[: 3 * BLOCK + 4] + [9999] * (2 * BLOCK)
    _, roi, k, v, h = select(client, other)
    assert int(roi.sum()) == 3 * BLOCK and roi[: 3 * BLOCK].all() and not roi[3 * BLOCK :].any()
    assert h is None
    assert same(k, key[:, : 3 * BLOCK]) and same(v, value[:, : 3 * BLOCK])


def test_prompt_shorter_than_one_block(client):
    tokens = [7, 8, 9]
    _, (key, value, hidden) = insert(client, tokens)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == 3 and same(k, key) and same(v, value) and same(h, hidden)
    assert (
        select(client, [7, 8]) == [None] * 5
    )  # a different short prompt: nothing block-aligned to share


def test_prompt_that_is_an_exact_multiple_of_the_block_size(client):
    tokens = list(range(100, 100 + 4 * BLOCK))
    _, (key, value, hidden) = insert(client, tokens)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == 4 * BLOCK and same(k, key) and same(h, hidden)
    assert client.lookup(tokens) == 4 * BLOCK


def test_insert_without_hidden_returns_exact_kv_and_no_hidden(client):
    tokens = list(range(500, 500 + 2 * BLOCK + 1))
    _, (key, value, _) = insert(client, tokens, hidden=False)
    _, roi, k, v, h = select(client, tokens)
    assert int(roi.sum()) == len(tokens) and h is None and same(k, key) and same(v, value)


def test_roi_marks_the_prefix_that_is_stored_and_looked_up(client):
    tokens = list(range(1000, 1000 + 3 * BLOCK))
    key, value, hidden = kv_for(client.namespace, tokens)
    roi = torch.zeros(len(tokens), dtype=torch.bool)
    roi[: 2 * BLOCK] = True
    client.insert(torch.tensor(tokens), roi, key, value, hidden)
    _, out_roi, k, _, h = client.select(torch.tensor(tokens), roi)
    assert (
        int(out_roi.sum()) == 2 * BLOCK and same(k, key[:, : 2 * BLOCK]) and h.shape[0] == 2 * BLOCK
    )


def test_second_session_sends_only_missing_pages_and_matches_shared_blocks(client):
    a = list(range(2000, 2000 + 8 * BLOCK))
    first, _ = insert(client, a)
    assert first.sent == 8 + 1 and first.skipped == 0  # 8 blocks + 1 tail part
    k = 5
    b = a[: k * BLOCK] + list(range(9000, 9000 + 3 * BLOCK))
    second, _ = insert(client, b)
    assert second.skipped == k and second.sent == 3 + 1
    sent_bytes = second.bytes_sent
    assert sent_bytes < 4 * client.namespace.page_nbytes + 1024 * 1024
    c = a[: k * BLOCK] + [1] * (2 * BLOCK)
    _, roi, _, _, h = select(client, c)
    assert int(roi.sum()) == k * BLOCK and h is None


def test_namespaces_never_match_each_other(cluster, ns):
    tokens = list(range(4 * BLOCK))
    with KVCacheClient(cluster.redis_url, ns) as writer:
        insert(writer, tokens)
        assert writer.lookup(tokens) == 4 * BLOCK
    for over in (
        {"model": "another"},
        {"dtype": "bfloat16"},
        {"tp_rank": 1, "tp_size": 2},
        {"tenant": "x"},
    ):
        other = ns.model_copy(update=over)
        other = Namespace.model_validate(other.model_dump())
        with KVCacheClient(cluster.redis_url, other) as reader:
            assert reader.lookup(tokens) == 0
            assert select(reader, tokens) == [None] * 5


def test_corrupt_checksum_counts_as_missing(cluster, ns, client):
    tokens = list(range(6 * BLOCK))
    client.put_pages(tokens, pages_for(ns, tokens))
    assert corrupt_entry_checksums(cluster.redis_url, ns, block_hashes(ns, tokens), 2) >= 1
    out = torch.empty(6, *ns.page_shape, dtype=torch.float16)
    assert client.get_pages(tokens, out) == 2 * BLOCK
    assert client.stats.checksum_failures == 1
    assert same(out[:2], pages_for(ns, tokens)[:2])


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda c, t: c.select(t, torch.tensor([True, False, True] + [False] * (len(t) - 3))),
            "prefix",
        ),
        (lambda c, t: c.select(t, torch.ones(len(t) - 1, dtype=torch.bool)), "shaped like"),
        (lambda c, t: c.select(t, torch.zeros(len(t), dtype=torch.bool)), "marks no tokens"),
        (lambda c, t: c.select(t, torch.ones(len(t), dtype=torch.int64)), "bool mask"),
        (
            lambda c, t: c.insert(
                t,
                torch.ones(len(t), dtype=torch.bool),
                torch.zeros(2, len(t), 2, 31, dtype=torch.float16),
                torch.zeros(2, len(t), 2, 32, dtype=torch.float16),
            ),
            "key has shape",
        ),
        (
            lambda c, t: c.insert(
                t,
                torch.ones(len(t), dtype=torch.bool),
                torch.zeros(2, len(t), 2, 32),
                torch.zeros(2, len(t), 2, 32),
            ),
            "dtype",
        ),
        (
            lambda c, t: c.get_pages(t, torch.zeros(1, 2, 2, BLOCK, 2, 32, dtype=torch.float16)),
            "at least 2",
        ),
        (
            lambda c, t: c.put_pages(t, torch.zeros(2, 3, 3, dtype=torch.float16)),
            "pages have shape",
        ),
        # select's plan: a sequence's pages land whole in IntoSequence, and nothing else does
        (
            lambda c, t: c.read(GetPlan(SequencePages([b"h" * 16], [b"p" * 16]), IntoPages(t))),
            "land whole .* SequencePages into IntoPages",
        ),
        (
            lambda c, t: c.read(GetPlan(Prompt(t), IntoSequence(len(t)))),
            "land whole .* Prompt into IntoSequence",
        ),
        (
            lambda c, t: c.read(
                GetPlan(SequencePages([b"h" * 16], [b"p" * 16]), IntoSequence(len(t)), 1)
            ),
            "from block 0",
        ),
    ],
)
def test_misuse_raises_value_errors_naming_the_problem(client, call, message):
    tokens = torch.arange(2 * BLOCK)
    with pytest.raises(InvalidInputError, match=message):
        call(client, tokens)
