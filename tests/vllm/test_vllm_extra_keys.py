"""vLLM's per-block extra keys read from its own Request objects, without an engine:
images at the same offset share only the blocks before them, and an extra key kvstore
cannot express makes a request unkeyable (logged once, neither looked up nor saved)."""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("vllm")

from kvstore import Namespace, block_hashes
from tests.support.vllm_runs import hit

BLOCK = 32
rng = random.Random(11)


NS = Namespace(
    model="tiny-llama-identity",
    dtype="float32",
    num_layers=2,
    num_kv_heads=2,
    head_size=32,
    block_size=BLOCK,
    layout="vllm_cpu",
)


def vllm_request(
    req_id: str, tokens: list[int] | None, *, images: list[tuple[str, int, int]] = (), **kwargs
):
    """A vLLM ``Request``; ``images``: (identifier, offset, length) of its multimodal items."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for ident, offset, length in images
    ]
    return Request(
        req_id, tokens, SamplingParams(max_tokens=1), None, mm_features=features or None, **kwargs
    )


def chain(request) -> list[bytes]:
    from client.vllm.identity import IdentityReader

    keyed = IdentityReader(BLOCK).keyed(request)
    return block_hashes(NS, keyed.tokens, keyed.extras)


def test_images_at_the_same_offset_share_only_the_blocks_before_them():
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    from client.vllm.identity import IdentityReader

    tokens = [
        rng.randrange(512) for _ in range(320)
    ]  # 10 full blocks; the image's placeholders at 100..149
    offset, first = 100, 100 // BLOCK
    plain = chain(vllm_request("plain", tokens))
    x = chain(vllm_request("x", tokens, images=[("image-x", offset, 50)]))
    y = chain(vllm_request("y", tokens, images=[("image-y", offset, 50)]))
    assert len(plain) == len(x) == len(y) == 10
    assert (
        x[:first] == y[:first] == plain[:first]
    )  # the blocks before the image are a plain request's
    assert not set(x[first:]) & set(y[first:]) and not set(x[first:]) & set(plain[first:])
    assert (
        chain(vllm_request("x-again", tokens, images=[("image-x", offset, 50)])) == x
    )  # the same image: the same pages
    # the same image elsewhere in the same tokens differs from its first block on
    moved = chain(vllm_request("x-moved", tokens, images=[("image-x", offset + 1, 50)]))
    assert moved[:first] == x[:first] and not set(moved[first:]) & set(x[first:])
    # two images: a different second one changes only the blocks from its own first block on
    second, second_first = 250, 250 // BLOCK
    xz = chain(
        vllm_request("xz", tokens, images=[("image-x", offset, 50), ("image-z", second, 40)])
    )
    xw = chain(
        vllm_request("xw", tokens, images=[("image-x", offset, 50), ("image-w", second, 40)])
    )
    assert xz[:second_first] == xw[:second_first] == x[:second_first]
    assert not set(xz[second_first:]) & set(xw[second_first:])
    # kvstore keys exactly the blocks vLLM's own extra keys name
    request = vllm_request(
        "xz-blocks", tokens, images=[("image-x", offset, 50), ("image-z", second, 40)]
    )
    keyed = IdentityReader(BLOCK).keyed(request)
    vllm_keyed = {
        b
        for b in range(10)
        if generate_block_hash_extra_keys(request, b * BLOCK, (b + 1) * BLOCK, 0)[0]
    }
    assert {b for b, _ in keyed.extras.digests} == vllm_keyed == {3, 4, 7, 8, 9}


@pytest.fixture()
def later_vllm(monkeypatch):
    """vLLM's ``generate_block_hash_extra_keys`` as a later vLLM's might be: one more kind
    of key, ("future_kind", 1), on the blocks of requests whose id starts with "future"."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys

    def later(request, start, end, start_mm_idx):
        keys, next_mm = original(request, start, end, start_mm_idx)
        if request.request_id.startswith("future"):
            keys = (*(keys or ()), ("future_kind", 1))
        return keys, next_mm

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", later)


def test_an_unknown_extra_key_makes_a_request_unkeyable_logged_once(later_vllm, caplog):
    from client.vllm.identity import IdentityReader, Unkeyable

    reader = IdentityReader(BLOCK)
    tokens = [rng.randrange(512) for _ in range(100)]
    assert reader.keyed(vllm_request("now", tokens, cache_salt="s")).extras  # a known key: keyed
    with caplog.at_level(logging.WARNING, logger="client.vllm.identity"):
        for req_id in ("future-1", "future-2"):
            with pytest.raises(Unkeyable, match="future_kind"):
                reader.keyed(vllm_request(req_id, tokens, cache_salt="s"))
    assert sum("future_kind" in r.getMessage() for r in caplog.records) == 1, caplog.text


class RecordingClient:
    """The scheduler's client, without a store: every lookup is a miss, and recorded."""

    def __init__(self) -> None:
        self.finds: list[int] = []

    def find(self, tokens, timeout=None, identity=None):
        self.finds.append(len(tokens))
        return None

    def close(self) -> None:
        pass


def test_the_scheduler_neither_looks_up_nor_saves_an_unkeyable_request(later_vllm):
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from client.vllm.feature_set import SchedulerFeatures
    from client.vllm.options import connector_options
    from client.vllm.scheduler import ConnectorScheduler
    from client.vllm.stats import StatsRecorder

    conf, _ = connector_options({"redis_url": "redis://127.0.0.1:1/0"})
    client, stats = RecordingClient(), StatsRecorder()
    scheduler = ConnectorScheduler(
        conf, client, BLOCK, stats=stats, features=SchedulerFeatures(saves=True)
    )
    tokens = [rng.randrange(512) for _ in range(100)]
    now, future = vllm_request("now", tokens), vllm_request("future", tokens)
    assert scheduler.get_num_new_matched_tokens(now, 0) == (0, False)
    assert client.finds == [hit(tokens)]  # the keyed request was looked up (a miss)
    for _ in range(2):  # vLLM may ask again while the request waits
        assert scheduler.get_num_new_matched_tokens(future, 0) == (0, False)
    assert client.finds == [hit(tokens)]
    assert stats.stats.data["unkeyed_requests"] == 1  # once per request
    # both prefills complete in one step: only the keyed request is saved
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [
        NewRequestData.from_request(r, ([0, 1, 2, 3],) if r is now else ([4, 5, 6, 7],))
        for r in (now, future)
    ]
    step.num_scheduled_tokens = {"now": len(tokens), "future": len(tokens)}
    step.total_num_scheduled_tokens = 2 * len(tokens)
    meta = scheduler.build_connector_meta(step)
    assert [(s.req_id, s.block_ids) for s in meta.saves] == [("now", [0, 1, 2])]
