"""Shared fixtures: a real Valkey server per test session and per-test namespaces."""

from __future__ import annotations

import os

import pytest

from kvstore.index import PageIndex
from kvstore.pages.namespace import Namespace
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.valkey import EmbeddedValkey
from tests.helpers import tenant_for

os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="session")
def valkey():
    with EmbeddedValkey() as server:
        yield server


@pytest.fixture()
def namespace(request) -> Namespace:
    """A namespace of small pages, unique to the test so tests never see each other's pages."""
    tenant = tenant_for(request.node.name)
    return Namespace(model="test-model", dtype="float16", num_layers=2, num_kv_heads=2, head_size=32, block_size=16, hidden_size=64, tenant=tenant)


@pytest.fixture()
def index(valkey):
    idx = PageIndex(valkey.url)
    yield idx
    idx.close()


@pytest.fixture()
def index_shards() -> int:
    """Shards of the embedded index ``clusters`` starts (1: a single Valkey). A module
    overrides this fixture to run its tests against a Valkey cluster too."""
    return 1


@pytest.fixture()
def clusters(index_shards):
    """Factory of local stores (embedded Valkey + node processes), stopped after the test."""
    made: list[LocalCluster] = []

    def make(servers: int = 1, capacity: str = "256MiB", slab: str = "16MiB", extra: list[str] | None = None, **kw) -> LocalCluster:
        cluster = LocalCluster(servers, capacity, slab_size=slab, extra_args=extra, index_shards=index_shards, **kw)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()
