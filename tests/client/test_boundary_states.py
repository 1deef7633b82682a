"""Chains stored at some blocks only: a hybrid state-space model's boundary states
(client.vllm.states). ``find(last=True)`` finds the last block stored and the fetch
brings that one page, against real nodes and Valkey (a single index and a 3-shard
cluster); ``boundary_saves`` picks the states the connector's scheduler saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from client import KVCacheClient
from client.memory.buffers import Span, host_bytes
from client.vllm.states import StateFacts, boundary_saves, state_facts, state_refusal
from kvstore.pages.identity import RequestIdentity
from kvstore.pages.namespace import Namespace
from tests.support.client_fixtures import BLOCK, cluster, same  # noqa: F401 (the cluster fixture)
from tests.support.helpers import tenant_for


def state_namespace(tenant: str) -> Namespace:
    return Namespace(
        model="states-test",
        dtype="int8",
        num_layers=2,
        num_kv_heads=1,
        head_size=96,
        block_size=BLOCK,
        layout="vllm_mamba_state",
        tenant=tenant,
    )


def fetched(client: KVCacheClient, found, block: int) -> torch.Tensor | None:
    """The one page of ``found`` at ``block``, None when it did not arrive."""
    page = torch.zeros((1, *client.namespace.page_shape), dtype=torch.int8)
    got = client.get_found_into(found, [Span(host_bytes(page), 0, page.numel())], block)
    return page if got == (block + 1) * BLOCK else None


@pytest.mark.parametrize("lease_ms", [5000, 0], ids=["leased", "no-lease"])
def test_the_last_stored_block_of_a_sparse_chain_is_found_and_fetched_bit_exact(
    cluster, request, lease_ms
):
    """States at blocks 2, 5 and 70 (past the first 64-block segment) of one prompt:
    each lookup ends at the last one within it, a lookup before the first finds none,
    and the page fetched is the one stored there (with no lease the fetch asks the
    index again, the same way). The chain read as an ordinary prefix has nothing: block
    0 holds no page. A prompt with a state at block 70 only is found too."""
    ns = state_namespace(tenant_for(request.node.name))
    client = KVCacheClient(cluster.redis_url, ns, timeout=5, lease_ms=lease_ms)
    try:
        tokens = [(13 * i + 1) % 30000 for i in range(80 * BLOCK)]
        gen = torch.Generator().manual_seed(3)
        pages = {
            n: torch.randint(-128, 127, (1, *ns.page_shape), dtype=torch.int8, generator=gen)
            for n in (2, 5, 70)
        }
        for n, page in pages.items():
            report = client.put_pages(tokens[: n * BLOCK], page, start_block=n - 1)
            assert report.refused == 0 and report.stored == 1
        for upto, last in [(1, 0), (2, 2), (4, 2), (5, 5), (64, 5), (80, 70)]:
            found = client.find(tokens[: upto * BLOCK], last=True)
            assert found is not None and found.blocks == last, (upto, found)
            if last:
                page = fetched(client, found, last - 1)
                assert page is not None and same(page, pages[last])
        plain = client.find(tokens[: 10 * BLOCK])
        assert plain is not None and plain.blocks == 0
        other = client.find(
            tokens[: 10 * BLOCK], last=True, identity=RequestIdentity(cache_salt="tenant-b")
        )
        assert other is not None and other.blocks == 0  # the request's identity keys states too
        # a prompt whose one state lies past a 64-block run without any (vLLM's default
        # retention keeps a prompt's last boundary only): every segment is read
        lone = [t + 1 for t in tokens]
        page = pages[70]
        assert client.put_pages(lone[: 70 * BLOCK], page, start_block=69).stored == 1
        found = client.find(lone, last=True)
        assert found is not None and found.blocks == 70
        got = fetched(client, found, 69)
        assert got is not None and same(got, page)
    finally:
        client.close()


FACTS = StateFacts(
    page_groups=(1,),
    state_groups=(0, 2),
    state_layers=("model.layers.0.mixer", "model.layers.2.mixer"),
    page_layers=("model.layers.1.mixer",),
    state_bytes=96,
    replicated=False,
    mode="align",
    block_size=4,
)


def scheduled(offloads: dict) -> SimpleNamespace:
    """A scheduler output's part ``boundary_saves`` reads: vLLM's boundary hand-offs."""
    return SimpleNamespace(
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offloads)
    )


def test_the_scheduler_saves_whole_block_boundaries_of_the_prompt_each_state_group_handed_over():
    """Saved: a boundary every state group handed over, at a whole block within the
    prompt. Not saved: a boundary one group lacks, a partial tail (inside a block), one
    past the prompt (generated tokens are not keyed), one in the null block, and a
    request the connector does not save."""
    prompt = list(range(14))
    extras = ((), (), (), ())
    prompts = {"a": (prompt, extras)}
    out = boundary_saves(
        scheduled(
            {
                "a": [
                    (0, 7, 4),
                    (2, 9, 4),  # both groups: saved
                    (0, 8, 8),  # group 2 lacks boundary 8
                    (0, 3, 10),
                    (2, 5, 10),  # inside block 2
                    (0, 4, 16),
                    (2, 6, 16),  # past the prompt's 14 tokens
                    (0, 0, 12),
                    (2, 11, 12),  # the null block
                    (1, 12, 12),  # an attention group's block
                ],
                "b": [(0, 1, 4), (2, 2, 4)],  # not saved by the connector
            }
        ),
        FACTS,
        prompts.get,
    )
    assert [(s.req_id, s.token_ids, s.block_ids) for s in out] == [("a", prompt[:4], [7, 9])]
    assert out[0].extras == extras
    assert boundary_saves(SimpleNamespace(), FACTS, prompts.get) == []  # no hand-offs this step


def test_states_of_other_formats_live_in_other_namespaces():
    """Two engines whose states have the same size but other dtypes (float16 and
    bfloat16), or whose states TP ranks split rather than replicate, read the bytes
    differently: their state formats, and so their namespaces, differ. A model with
    two kinds of state layers is refused in one line."""
    vllm_specs = pytest.importorskip("vllm.v1.kv_cache_interface")

    def config(*dtypes: torch.dtype, replicated: bool = False):
        states = [
            vllm_specs.KVCacheGroupSpec(
                [f"model.layers.{2 * i}.mixer"],
                vllm_specs.MambaSpec(
                    block_size=16,
                    shapes=((3, 8), (2, 4, 4)),
                    dtypes=(dtype, dtype),
                    mamba_cache_mode="align",
                    tp_replicated=replicated,
                ),
            )
            for i, dtype in enumerate(dtypes)
        ]
        attention = vllm_specs.FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
        )
        groups = [*states, vllm_specs.KVCacheGroupSpec(["model.layers.1.self_attn"], attention)]
        return vllm_specs.KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)

    half, brain, shared = (
        state_facts(config(torch.float16)),
        state_facts(config(torch.bfloat16)),
        state_facts(config(torch.float16, replicated=True)),
    )
    assert half is not None and brain is not None and shared is not None
    assert half.state_bytes == brain.state_bytes == 112
    formats = {half.state_format, brain.state_format, shared.state_format}
    assert len(formats) == 3
    digests = {
        state_namespace("states-format").model_copy(update={"state": f}).digest for f in formats
    }
    assert len(digests) == 3
    mixed = state_facts(config(torch.float16, torch.bfloat16))
    assert mixed is not None and not mixed.uniform
    refusal = state_refusal(SimpleNamespace(), mixed)  # refused before the config is read
    assert refusal is not None and "different state formats" in refusal


def test_a_workers_state_is_saved_from_its_blocks_and_loaded_into_another_block(cluster, request):
    """The worker's side (client.vllm.state_pages) against real nodes: a state copied out
    of two layers' blocks (one per state group) is published through the save queue as
    the prefix's last block; a load writes it bit-exact into other blocks and counts its
    bytes. When a state group's block is vLLM's null block, the load fails whole
    (recomputed) and writes nothing. The save queue's events module imports vLLM's
    event types, so this test needs vLLM (README's setup without its line skips it)."""
    pytest.importorskip("vllm")
    from client.paging.loader import LoadOutcome
    from client.paging.specs import LoadSpec
    from client.vllm.saver import SaveQueue
    from client.vllm.state_pages import StatePages
    from client.vllm.states import StateSpec
    from client.vllm.stats import StatsRecorder

    ns = state_namespace(tenant_for(request.node.name))
    client = KVCacheClient(cluster.redis_url, ns, timeout=5)
    saves = SaveQueue(1 << 20, StatsRecorder(), lambda exc: None)
    saves.start()
    try:
        gen = torch.Generator().manual_seed(5)
        layers = [
            torch.randint(-128, 127, (6, 1, 1, 128), dtype=torch.int8, generator=gen)
            for _ in range(2)
        ]  # vLLM's int8 view of a state layer, padded past its 96 bytes
        pages = StatePages(client, [layer.clone() for layer in layers], [0, 1], 96)
        tokens = [(7 * i + 2) % 30000 for i in range(3 * BLOCK)]
        pages.save(StateSpec("r", tokens, [4, 2]), saves, BLOCK)
        saves.shutdown()
        found = client.find(tokens, last=True)
        assert found is not None and found.blocks == 3
        target = [torch.zeros_like(layer) for layer in layers]
        loading = StatePages(client, target, [0, 1], 96)
        spec = LoadSpec("r", found, [11, 12, 13], 0, state_found=found, state_block_ids=[1, 5])
        done = loading.load_after(spec, LoadOutcome([], 100, 0.0), lambda exc: None)
        assert done.failed == [] and done.nbytes == 100 + 2 * 96
        assert torch.equal(target[0][1].flatten()[:96], layers[0][4].flatten()[:96])
        assert torch.equal(target[1][5].flatten()[:96], layers[1][2].flatten()[:96])
        assert not target[0][4].any() and not target[1][1].any()  # only the allocated blocks
        empty = [torch.zeros_like(layer) for layer in layers]
        stale = StatePages(client, empty, [0, 1], 96)
        missing = LoadSpec(
            "s", found, [11, 12, 13], 0, state_found=found.head(3), state_block_ids=[0, 5]
        )  # block 0: vLLM's null block, no state to write
        failed = stale.load_after(missing, LoadOutcome([], 100, 0.0), lambda exc: None)
        assert failed.failed == [11, 12, 13] and failed.nbytes == 100
        assert not any(t.any() for t in empty)
    finally:
        saves.shutdown()
        client.close()
