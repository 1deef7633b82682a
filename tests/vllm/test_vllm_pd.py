"""The P/D handoff in this process (tests/support/connector_harness.py: vLLM's own scheduler and
the connector's two halves over a real storage node and Valkey): a prefill asked to
hand over (``do_remote_decode``) announces what its save stores, and a decode given
those params waits for the pages instead of recomputing them, bounded by
``remote_prefill_wait_ms``."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")

from client.vllm.transfer_params import announcement
from kvstore.pages.identity import NO_EXTRAS
from kvstore.tools.launcher import LocalCluster
from tests.support.connector_harness import BLOCK, ConnectorHarness, write_config
from tests.support.helpers import wait_for

rng = random.Random(23)
PROMPT = [rng.randrange(512) for _ in range(200)]  # 6 full blocks + 8 tokens
OTHER = [rng.randrange(512) for _ in range(200)]
FULL = len(PROMPT) // BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture(scope="module")
def baseline(model_dir) -> dict[str, list[int]]:
    """What each prompt generates computed whole (an index that is not there)."""
    with ConnectorHarness(model_dir, "redis://127.0.0.1:1/0", role="kv_consumer") as engine:
        out = engine.generate({"p": PROMPT, "o": OTHER})
    return {name: r.tokens for name, r in out.items()}


@pytest.fixture()
def cluster():
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
        yield cluster


def stored(cluster: LocalCluster) -> int:
    from kvstore.index import PageIndex

    index = PageIndex(cluster.redis_url)
    try:
        return sum(s.pages for s in index.stats().namespaces)
    finally:
        index.close()


def decode_engine(model_dir, cluster, wait_ms: float = 5000) -> ConnectorHarness:
    return ConnectorHarness(
        model_dir,
        cluster.redis_url,
        role="kv_consumer",
        extra={"remote_prefill_wait_ms": wait_ms},
    )


def decode(engine: ConnectorHarness, params: dict) -> float:
    """``engine`` given PROMPT with ``params``: steps until it finished, checking every
    position of its cache once its prompt is in; the seconds it took."""
    engine.add("d", PROMPT, **params)
    started = time.monotonic()
    wrong = None
    while engine.scheduler.has_requests():
        engine.step()
        if wrong is None and engine.steps[-1].get("d"):
            wrong = engine.check_cache("d", PROMPT, len(PROMPT))
    assert wrong == []
    return time.monotonic() - started


def test_the_decode_waits_for_the_prefix_its_prefill_announced(model_dir, baseline, cluster):
    """The race the seeds never lose: the prefill answers while its save is still on its
    way (its node stopped for a second here; a cold engine or a loaded machine in the
    field). The decode claims the announced blocks at once, waits, and loads every one
    of them: no block recomputed, the tokens of a whole computation."""
    node = cluster.nodes[0].process
    with (
        ConnectorHarness(model_dir, cluster.redis_url, role="kv_producer") as prefill,
        decode_engine(model_dir, cluster) as engine,
    ):
        prefill.add("p", PROMPT, max_tokens=1, do_remote_decode=True)
        node.send_signal(signal.SIGSTOP)
        resumed = threading.Timer(1.0, node.send_signal, (signal.SIGCONT,))
        try:
            params = prefill.run()["p"].kv_transfer_params
            assert stored(cluster) == 0  # the save waits for the node
            # vLLM adds the prefill's own cache hits (remote_prefill_cached_tokens)
            assert params == {
                **announcement(BLOCK, PROMPT, NO_EXTRAS, FULL),
                "remote_prefill_cached_tokens": 0,
            }
            assert params["do_remote_prefill"] is True and params["kvstore_blocks"] == FULL
            resumed.start()
            took = decode(engine, params)
        finally:
            resumed.cancel()
            node.send_signal(signal.SIGCONT)
        finished, metrics = engine.finished["d"], engine.metrics()
    assert finished.tokens == baseline["p"] and finished.num_cached_tokens == FULL * BLOCK
    assert metrics["remote_prefills_announced"] == 1 and metrics["remote_prefills_in_time"] == 1
    assert metrics.get("remote_prefill_deadline_misses", 0) == 0
    assert metrics.get("load_failed_blocks", 0) == 0 and metrics.get("lookups", 0) == 0
    (waited,) = metrics["remote_prefill_wait_seconds"]
    assert 0.5 < waited < took  # it waited for the node, and no longer than the decode took
    # a handful of lookups, not a tight loop: at most one per 50 ms after the first few
    assert metrics["remote_prefill_lookups"] <= 10 + waited / 0.05


def test_past_the_deadline_the_decode_computes_what_never_arrived(model_dir, baseline, cluster):
    """A prefill whose save never lands (it failed, or the prefill died): the decode
    ends its wait at the deadline, computes the blocks itself (counted), and is right."""
    params = announcement(BLOCK, PROMPT, NO_EXTRAS, FULL)  # nothing is ever saved
    with decode_engine(model_dir, cluster, wait_ms=400) as engine:
        took = decode(engine, params)
        finished, metrics = engine.finished["d"], engine.metrics()
    assert finished.tokens == baseline["p"] and finished.num_cached_tokens == 0
    assert metrics["remote_prefill_deadline_misses"] == 1
    assert metrics["remote_prefill_recomputed_tokens"] == FULL * BLOCK
    assert 0.4 <= max(metrics["remote_prefill_wait_seconds"]) < 1.4 and took < 1.4 + 2


def test_a_partly_stored_prefix_loads_what_arrived_and_computes_the_rest(
    model_dir, baseline, cluster
):
    """Four of six announced blocks stored by the deadline (a prefill killed mid-save):
    those four are loaded, the last two computed."""
    with ConnectorHarness(model_dir, cluster.redis_url, role="kv_producer") as prefill:
        prefill.generate({"p": PROMPT[: 4 * BLOCK + 1]}, max_tokens=1)
    wait_for(lambda: stored(cluster) >= 4, 5, "the first four blocks to be stored")
    with decode_engine(model_dir, cluster, wait_ms=300) as engine:
        decode(engine, announcement(BLOCK, PROMPT, NO_EXTRAS, FULL))
        finished, metrics = engine.finished["d"], engine.metrics()
    # vLLM counts the claimed tokens as cached; the two failed blocks were computed
    assert finished.tokens == baseline["p"] and finished.num_cached_tokens == FULL * BLOCK
    assert metrics["load_failed_blocks"] == 2 and metrics["remote_prefill_deadline_misses"] == 1
    assert metrics["remote_prefill_recomputed_tokens"] == 2 * BLOCK


def test_params_for_another_prompt_are_not_waited_for(model_dir, baseline, cluster):
    """Params a proxy paired with the wrong request (or another identity): counted, the
    request is looked up as any other, and no time is spent waiting."""
    with decode_engine(model_dir, cluster) as engine:
        took = decode(engine, announcement(BLOCK, OTHER, NO_EXTRAS, FULL))
        finished, metrics = engine.finished["d"], engine.metrics()
    assert finished.tokens == baseline["p"] and finished.num_cached_tokens == 0
    assert metrics["remote_prefill_mismatches"] == 1 and metrics["lookups"] == 1
    assert metrics.get("remote_prefills_announced", 0) == 0 and took < 3


def test_a_chunked_prefill_publishes_its_first_chunks_before_its_last(model_dir, baseline, cluster):
    """64 tokens a step: the blocks of the prompt's first chunks are stored while later
    chunks are still being computed, so a decode waits for the last chunk's save only;
    the decode then loads all six blocks."""
    with (
        ConnectorHarness(
            model_dir, cluster.redis_url, role="kv_producer", max_batched=64
        ) as prefill,
        decode_engine(model_dir, cluster) as engine,
    ):
        prefill.add("p", PROMPT, max_tokens=1, do_remote_decode=True)
        prefill.step()
        prefill.step()  # 128 of 200 tokens computed: four blocks full
        wait_for(lambda: stored(cluster) >= 4, 5, "the first chunks' blocks to be stored")
        assert stored(cluster) == 4 and prefill.scheduler.has_requests()
        params = prefill.run()["p"].kv_transfer_params
        assert params["kvstore_blocks"] == FULL
        decode(engine, params)
        finished, metrics = engine.finished["d"], engine.metrics()
    assert finished.tokens == baseline["p"] and finished.num_cached_tokens == FULL * BLOCK
    assert metrics["remote_prefills_in_time"] == 1 and metrics.get("load_failed_blocks", 0) == 0
