"""Dynamo's own KV indexer against what a store shares beyond one node's stream: the
connector's saves, published by vLLM's own publisher under ``kv_events_profile:
dynamo``, and a store of several nodes seen as one Dynamo worker, the pool (issue 52;
docs/router-integration.md, "One pool, many engines"). Skipped without Dynamo, as
tests/dynamo/test_router_dynamo.py is."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstore import block_hashes
from kvstore.events import u64_hash
from kvstore.index import PageIndex
from tests.support.dynamo_fixtures import (  # noqa: F401 (the dynamo fixture)
    OPTS,
    PAGE,
    dynamo,
    free_port,
    prompts,
    put,
    skip_without_dynamo,
)
from tests.support.helpers import (
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
    worker_result,
)

pytestmark = skip_without_dynamo


def test_dynamo_scores_the_connectors_saves_under_the_dynamo_profile(clusters, dynamo, tmp_path):
    """The connector's events, published by vLLM's own publisher from an in-process
    scheduler and worker (tests/support/connector_harness.py), under ``kv_events_profile:
    dynamo``: Dynamo credits the engine's worker with each saved prompt on its host tier."""
    pytest.importorskip("vllm")
    from tests.support.connector_harness import BLOCK, ConnectorHarness, write_config

    cluster = clusters()
    pub = free_port()
    model = "connector-events"
    with ConnectorHarness(
        write_config(tmp_path),
        cluster.redis_url,
        extra={"kv_events_profile": "dynamo"},
        events_endpoint=f"tcp://*:{pub}",
    ) as engine:
        dynamo.register(f"tcp://127.0.0.1:{pub}", model, BLOCK)
        for k in range(50):  # ZMQ's slow joiner: save one-block prompts until one is scored
            warm = list(range(700_000 + k * BLOCK, 700_000 + (k + 1) * BLOCK + 1))
            engine.generate({f"warm-{k}": warm}, max_tokens=1)
            try:
                wait_for(lambda w=warm: dynamo.host_tokens(model, w) == BLOCK, 1, "")
                break
            except AssertionError:
                continue
        else:
            raise AssertionError(f"Dynamo indexed no event of the engine: {dynamo.warnings()}")
        prompt = list(range(10, 10 + 4 * BLOCK + 5))
        engine.generate({"four-blocks": prompt}, max_tokens=2)
        wait_for(
            lambda: dynamo.host_tokens(model, prompt) == 4 * BLOCK, 10, "the saved prompt's blocks"
        )
        assert dynamo.host_tokens(model, prompt[: 2 * BLOCK] + [9] * BLOCK) == 2 * BLOCK
    assert not [w for w in dynamo.warnings() if "decode" in w.lower()], dynamo.warnings()


POOL = 11  # the Dynamo worker id the store's nodes are registered under


def test_a_store_is_one_dynamo_worker_that_holds_each_block_once(clusters, dynamo):
    """Eight engines (client processes) save the same prompts into a store of two nodes
    that publish under one store id and the dynamo profile; Dynamo is given each node as
    a data-parallel rank of one worker, the pool. Each stored block is announced once,
    however many engines saved it, and Dynamo credits the pool and no one else. Dynamo
    1.6.1 keeps a tree per rank and a node's events name no parent, so the pool scores,
    per prompt, the run of leading blocks one node holds (docs/router-integration.md)."""
    from tests.support.node_events import replay

    pubs, reps = [free_port(), free_port()], [free_port(), free_port()]

    def node_args(i: int) -> list[str]:
        return [
            "--kv-events-endpoint",
            f"tcp://*:{pubs[i]}",
            "--kv-events-replay-endpoint",
            f"tcp://*:{reps[i]}",
        ]

    cluster = clusters(
        capacity="64MiB",
        slab="1MiB",
        extra=["--kv-events-profile", "dynamo", "--kv-events-store-id", "pool", *node_args(0)],
    )
    cluster.add_node("node-1", node_args(1))
    cluster.wait_registered()
    ns = namespace_for_page_size(PAGE, tenant="pool")
    bs = ns.block_size
    for rank, pub in enumerate(pubs):
        dynamo.post(
            "/register",
            {
                "instance_id": POOL,
                "dp_rank": rank,
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "model_name": ns.model,
                "block_size": bs,
            },
        )
    index = PageIndex(cluster.redis_url)

    def holder(tokens: list[int]) -> list[str]:
        """The node holding each stored block of ``tokens``, in prefix order."""
        found = index.lookup(ns, block_hashes(ns, tokens), lease_ms=0).resolve(index.live_nodes())
        return [where[0].node_id for where in found.locations]

    try:
        # ZMQ's slow joiner, per node: one-block prompts until one on each node is scored
        seen: set[str] = set()
        for k in range(100):
            warm = prompts(ns, 1, 1, base=900 + k)[0]
            put(cluster, ns, [warm])
            (node,) = holder(warm)
            if node not in seen:
                try:
                    wait_for(lambda w=warm: dynamo.host_tokens(ns.model, w, POOL) == bs, 1, "")
                    seen.add(node)
                except AssertionError:
                    pass
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"Dynamo indexed events of {seen} only: {dynamo.warnings()}"

        shared = prompts(ns, 3, 6, base=10)
        savers = [
            run_worker(
                spec(cluster, ns, "put_pages", token_lists=shared, options=OPTS), background=True
            )
            for _ in range(8)
        ]
        for proc in savers:
            worker_result(proc)
        for rank in range(2):
            wait_for(
                lambda r=rank: metrics(cluster, f"node-{r}")["kvstore_events_queued"] == 0,
                10,
                "the nodes' queues to drain",
            )
        # each block the eight engines saved was announced once, by the node holding it
        announced = Counter(
            h
            for port in reps
            for _, _, batch in replay(port, keys=None)
            for e in batch.events
            if type(e).__name__ == "BlockStored"
            for h in e.block_hashes
        )
        blocks = [u64_hash(h) for p in shared for h in block_hashes(ns, p)]
        assert {h: announced[h] for h in blocks} == dict.fromkeys(blocks, 1)

        for p in shared:
            nodes = holder(p)
            assert len(nodes) == 6
            run = next((i for i, n in enumerate(nodes) if n != nodes[0]), len(nodes))
            got = dynamo.post("/query", {"token_ids": p, "model_name": ns.model})
            assert set(got["instances"]) == {str(POOL)}, got  # the pool, and no engine
            assert got["instances"][str(POOL)]["cpu"] == run * bs, (nodes, got)
    finally:
        index.close()
    assert not [w for w in dynamo.warnings() if "decode" in w.lower()], dynamo.warnings()
