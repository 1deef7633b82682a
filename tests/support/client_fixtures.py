"""Fixtures and helpers of the client tests that share a store (tests/client/:
test_insert_select.py, test_boundary_states.py, test_nodes.py, test_paged_api.py): two
storage nodes (on one Valkey, and on a 3-shard cluster), a namespace per test, a
client, and insert/select helpers."""

from __future__ import annotations

import pytest
import torch

from client import KVCacheClient
from kvstore import Namespace
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import kv_for, tenant_for

BLOCK = 16


@pytest.fixture(scope="module", params=[1, 3], ids=["valkey", "cluster3"])
def cluster(request):
    """Two storage nodes on a single Valkey, then on a 3-shard Valkey cluster."""
    with LocalCluster(
        servers=2, capacity="512MiB", slab_size="16MiB", index_shards=request.param
    ) as c:
        yield c


@pytest.fixture(scope="module")
def single_index_cluster():
    """Two storage nodes on a single Valkey, for data-path tests the index shape does not touch."""
    with LocalCluster(servers=2, capacity="512MiB", slab_size="16MiB") as c:
        yield c


def make_ns(tenant: str, **over) -> Namespace:
    fields = dict(
        model="client-test",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        hidden_size=64,
        tenant=tenant,
    )
    fields.update(over)
    return Namespace(**fields)


@pytest.fixture()
def ns(request) -> Namespace:
    return make_ns(tenant_for(request.node.name))


@pytest.fixture()
def client(cluster, ns):
    c = KVCacheClient(cluster.redis_url, ns, timeout=5)
    yield c
    c.close()


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def insert(client, tokens, hidden=True):
    key, value, h = kv_for(client.namespace, tokens)
    roi = torch.ones(len(tokens), dtype=torch.bool)
    return client.insert(torch.tensor(tokens), roi, key, value, h if hidden else None), (
        key,
        value,
        h,
    )


def select(client, tokens):
    return client.select(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool))
