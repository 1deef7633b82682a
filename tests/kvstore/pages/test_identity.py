"""Request identity (kvstore.pages.identity): what enters a block hash besides the
tokens, in the hash itself (golden vectors, vLLM's sharing rules) and through the
client's paged and lookup-buffer APIs against real storage nodes."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client import KVCacheClient
from kvstore import InvalidInputError, Namespace, block_hash_bytes, block_hashes, sequence_hash
from kvstore.pages.hashing import reference_block_hashes
from kvstore.pages.identity import BlockExtras, MultimodalItem, RequestIdentity
from kvstore.pages.weights import fingerprint
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import kv_for, pages_for, tenant_for

GOLDEN_NS = Namespace(
    model="golden/llama", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64, block_size=4
)
TOKENS = list(range(10))
IMAGE = MultimodalItem(hash="img-a", offset=5, length=4)  # placeholder tokens 5..8: blocks 1 and 2


def hexes(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def test_golden_identity_vectors():
    """docs/key-format.md quotes these: a salted, a LoRA and a multimodal request."""
    plain = hexes(block_hashes(GOLDEN_NS, TOKENS))
    assert plain == [
        "6d59d525a5e319f519388e3944063b8a",
        "6f9f53b6b606d9a02c411df77a2e38cd",
    ]  # unchanged by identities
    salted = RequestIdentity(cache_salt="alpha").block_extras(4, 10)
    assert (
        salted.digests[0][0] == 0
        and salted.digests[0][1].hex() == "8766d8bec2b9a7a3e33fe5e8a4a68890"
    )
    assert hexes(block_hashes(GOLDEN_NS, TOKENS, salted)) == [
        "26f3a74e3aad97fca3d5240dfc8456ec",
        "f41310a287bf417ce8bbeddb817ce9f7",
    ]
    lora = RequestIdentity(adapter="adapter-a").block_extras(4, 10)
    assert lora.digests[0][1].hex() == "2a0a8b09647ff9124d9e78f1bfd51066"
    assert hexes(block_hashes(GOLDEN_NS, TOKENS, lora)) == [
        "4f56c3dda2490b6d0806913eb1d042e6",
        "36c905c66a96f898d686011a17bd8be9",
    ]
    image = RequestIdentity(multimodal=(IMAGE,)).block_extras(4, 10)
    assert [(b, d.hex()) for b, d in image.digests] == [
        (1, "804b45d68d600fd383a9feee168cc027"),
        (2, "486402bb2e65edd70c3c796c785292ca"),
    ]
    assert hexes(block_hashes(GOLDEN_NS, TOKENS, image)) == [
        plain[0],
        "8f62496881c4b927ed1657cd8bb11620",
    ]


def test_identity_digest_matches_documented_construction():
    def text(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    both = RequestIdentity(adapter="a", cache_salt="s").block_extras(4, 10)
    expected0 = hashlib.blake2b(
        b"L" + text("a") + b"S" + text("s"), digest_size=16, person=b"kvs-extra-v1"
    ).digest()
    assert both.digests == ((0, expected0),)
    image = RequestIdentity(multimodal=(IMAGE,)).block_extras(4, 10)
    block2 = hashlib.blake2b(
        b"M" + text("img-a") + struct.pack("<qq", 5 - 8, 4), digest_size=16, person=b"kvs-extra-v1"
    ).digest()
    assert image.at(2) == block2  # began in block 1: offset from block 2's start is -3
    tokens = np.arange(10, dtype="<u4")
    first = hashlib.blake2b(
        GOLDEN_NS.digest + bytes(16) + tokens[:4].tobytes() + expected0,
        digest_size=16,
        person=b"kvs-blockx-v1",
    ).digest()
    second = hashlib.blake2b(
        GOLDEN_NS.digest + first + tokens[4:8].tobytes(), digest_size=16, person=b"kvs-block-v1"
    ).digest()
    assert block_hashes(GOLDEN_NS, tokens, both) == [first, second]


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16, 25]),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    marked=st.lists(st.integers(0, 40), max_size=6),
)
def test_the_c_chain_with_extras_equals_the_hashlib_construction(block_size, tokens, marked):
    ns = Namespace(
        model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, block_size=block_size
    )
    extras = BlockExtras(
        tuple(
            sorted(
                {b: hashlib.blake2b(bytes([b]), digest_size=16).digest() for b in marked}.items()
            )
        )
    )
    expected = reference_block_hashes(ns, tokens, extras)
    assert block_hashes(ns, tokens, extras) == expected
    assert block_hash_bytes(ns, np.array(tokens, dtype=np.int64), extras) == b"".join(expected)
    # blocks before the first marked one are the plain chain's
    first = min([b for b in marked if b < len(expected)], default=len(expected))
    assert expected[:first] == block_hashes(ns, tokens)[:first]


def test_vllm_sharing_rules_salt_lora_and_an_image_in_the_middle():
    tokens = list(range(40))  # 10 blocks of 4
    plain = block_hashes(GOLDEN_NS, tokens)
    for identity in (
        RequestIdentity(cache_salt="x"),
        RequestIdentity(adapter="a"),
        RequestIdentity(weights_revision="step-2"),
    ):
        keyed = block_hashes(GOLDEN_NS, tokens, identity.block_extras(4, 40))
        assert not set(keyed) & set(plain)  # shares nothing with plain requests
    salt_x = block_hashes(GOLDEN_NS, tokens, RequestIdentity(cache_salt="x").block_extras(4, 40))
    salt_y = block_hashes(GOLDEN_NS, tokens, RequestIdentity(cache_salt="y").block_extras(4, 40))
    assert not set(salt_x) & set(salt_y)
    # an image at token 21: the 5 blocks before it are shared with plain requests, none after
    a = block_hashes(
        GOLDEN_NS,
        tokens,
        RequestIdentity(multimodal=(MultimodalItem(hash="A", offset=21, length=6),)).block_extras(
            4, 40
        ),
    )
    b = block_hashes(
        GOLDEN_NS,
        tokens,
        RequestIdentity(multimodal=(MultimodalItem(hash="B", offset=21, length=6),)).block_extras(
            4, 40
        ),
    )
    assert a[:5] == plain[:5] == b[:5]
    assert all(x != y for x, y in zip(a[5:], b[5:])) and all(
        x != y for x, y in zip(a[5:], plain[5:])
    )
    # the same image one token later: another key from its first block on
    later = block_hashes(
        GOLDEN_NS,
        tokens,
        RequestIdentity(multimodal=(MultimodalItem(hash="A", offset=22, length=6),)).block_extras(
            4, 40
        ),
    )
    assert later[:5] == a[:5] and later[5] != a[5]


def test_prompt_embeddings_key_every_block_by_its_rows():
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(12, 8, generator=g, dtype=torch.float32)
    other = embeds.clone()
    other[9, 3] += 1  # one value of block 2
    tokens = [0] * 12
    same = block_hashes(
        GOLDEN_NS, tokens, RequestIdentity(prompt_embeds=embeds).block_extras(4, 12)
    )
    again = block_hashes(
        GOLDEN_NS, tokens, RequestIdentity(prompt_embeds=embeds.clone()).block_extras(4, 12)
    )
    changed = block_hashes(
        GOLDEN_NS, tokens, RequestIdentity(prompt_embeds=other).block_extras(4, 12)
    )
    assert same == again and same[:2] == changed[:2] and same[2] != changed[2]
    bf16 = RequestIdentity(prompt_embeds=embeds.to(torch.bfloat16)).block_extras(
        4, 12
    )  # no numpy dtype: hashed as its bits
    assert len(bf16.digests) == 3 and bf16 != RequestIdentity(prompt_embeds=embeds).block_extras(
        4, 12
    )
    assert RequestIdentity(prompt_embeds=embeds.numpy()).block_extras(4, 12) == RequestIdentity(
        prompt_embeds=embeds
    ).block_extras(4, 12)
    with pytest.raises(InvalidInputError, match="prompt_embeds has 12 rows for 16 tokens"):
        RequestIdentity(prompt_embeds=embeds).block_extras(4, 16)
    with pytest.raises(ValueError, match="prompt_embeds must be a 2-D tensor"):
        RequestIdentity(prompt_embeds=torch.zeros(3))


def test_a_partial_tail_keeps_its_identity_in_the_sequence_hash():
    short = [1, 2, 3]  # no full block: the salt reaches only the tail
    assert sequence_hash(GOLDEN_NS, short) != sequence_hash(
        GOLDEN_NS, short, extras=RequestIdentity(cache_salt="s").block_extras(4, 3)
    )
    assert sequence_hash(
        GOLDEN_NS, short, extras=RequestIdentity().block_extras(4, 3)
    ) == sequence_hash(GOLDEN_NS, short)


def test_bad_identities_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="cache_salt"):
        RequestIdentity(cache_salt="")
    with pytest.raises(ValueError, match="offset"):
        MultimodalItem(hash="h", offset=-1, length=2)
    with pytest.raises(ValueError, match="salt"):
        RequestIdentity(salt="x")


def test_weights_fingerprint_follows_content_not_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB: read whole
    assert fingerprint(a) == fingerprint(b) and fingerprint(a).startswith("fp:")
    (b / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 4096)
    assert fingerprint(a) != fingerprint(b)
    big = np.random.default_rng(0).integers(0, 256, 40 << 20, dtype=np.uint8)
    (a / "model.safetensors").write_bytes(big.tobytes())  # 40 MiB: sampled
    before = fingerprint(a)
    big[-1] ^= 1  # the last byte is in the last sample
    (a / "model.safetensors").write_bytes(big.tobytes())
    assert fingerprint(a) != before
    assert (
        fingerprint(tmp_path / "missing") is None and fingerprint("meta-llama/Llama-3.1-8B") is None
    )
    (b / "model.safetensors").unlink()
    assert fingerprint(b) is None  # no weight file: not a checkpoint


# ---- through the client, real nodes ---------------------------------------------------------

BLOCK = 16


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(servers=1, capacity="256MiB", slab_size="16MiB") as c:
        yield c


def make_ns(request, **over) -> Namespace:
    return Namespace(
        model="identity-test",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=BLOCK,
        tenant=tenant_for(request.node.name),
        **over,
    )


def test_paged_api_an_identity_reads_only_its_own_pages(cluster, request):
    ns = make_ns(request)
    tokens = list(range(4 * BLOCK + 3))
    salted = RequestIdentity(cache_salt="alpha", adapter="adapter-a")
    with KVCacheClient(cluster.redis_url, ns, timeout=5) as client:
        pages = pages_for(ns, tokens)
        assert client.put_pages(tokens, pages, identity=salted).stored == 4
        assert client.lookup(tokens, identity=salted) == 4 * BLOCK
        for other in (
            None,
            RequestIdentity(cache_salt="beta", adapter="adapter-a"),
            RequestIdentity(cache_salt="alpha"),
            RequestIdentity(cache_salt="alpha", adapter="adapter-b"),
        ):
            assert client.lookup(tokens, identity=other) == 0, other
        out = torch.zeros_like(pages)
        assert client.get_pages(tokens, out, identity=salted) == 4 * BLOCK and torch.equal(
            out.view(torch.uint8), pages.view(torch.uint8)
        )
        assert client.get_pages(tokens, torch.zeros_like(pages)) == 0
        # an image in block 2: blocks 0-1 are shared with the plain request's pages
        plain = pages_for(ns, tokens)
        client.put_pages(tokens, plain)
        image = RequestIdentity(
            multimodal=(MultimodalItem(hash="img", offset=2 * BLOCK + 1, length=5),)
        )
        assert client.lookup(tokens, identity=image) == 2 * BLOCK
        found = client.find(
            tokens, identity=image.block_extras(BLOCK, len(tokens))
        )  # resolved once, as the connector does
        assert found.tokens == 2 * BLOCK


def test_insert_select_an_identity_selects_only_its_own_sequence(cluster, request):
    ns = make_ns(request, hidden_size=64)
    tokens = list(range(700, 700 + 2 * BLOCK + 5))
    key, value, hidden = kv_for(ns, tokens)
    roi = torch.ones(len(tokens), dtype=torch.bool)
    mine = RequestIdentity(cache_salt="tenant-a-user-1", adapter="sql-lora")
    with KVCacheClient(cluster.redis_url, ns, timeout=5) as client:
        client.insert(torch.tensor(tokens), roi, key, value, hidden, identity=mine)
        _, got_roi, k, v, h = client.select(torch.tensor(tokens), roi, identity=mine)
        assert int(got_roi.sum()) == len(tokens) and all(
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            for a, b in ((k, key), (v, value), (h, hidden))
        )
        for other in (
            None,
            RequestIdentity(cache_salt="tenant-a-user-2", adapter="sql-lora"),
            RequestIdentity(cache_salt="tenant-a-user-1"),
        ):
            assert client.select(torch.tensor(tokens), roi, identity=other) == [None] * 5, other
        # a sequence shorter than a block: only its tail carries the identity
        client.insert(
            torch.tensor(tokens[:5]), roi[:5], key[:, :5], value[:, :5], hidden[:5], identity=mine
        )
        assert client.select(torch.tensor(tokens[:5]), roi[:5])[0] is None
        assert client.select(torch.tensor(tokens[:5]), roi[:5], identity=mine)[1].sum() == 5
        with pytest.raises(
            InvalidInputError, match="identity must be a RequestIdentity or BlockExtras"
        ):
            client.lookup(tokens, identity="alpha")


def test_weights_revision_is_part_of_the_namespace(cluster, request):
    ns = make_ns(request)
    tokens = list(range(3 * BLOCK))
    with KVCacheClient(cluster.redis_url, ns, timeout=5, weights_revision="step-1") as old:
        assert old.namespace.weights == "step-1"
        old.put_pages(tokens, pages_for(old.namespace, tokens))
        assert old.lookup(tokens) == 3 * BLOCK
    with KVCacheClient(cluster.redis_url, ns, timeout=5, weights_revision="step-2") as new:
        assert new.lookup(tokens) == 0
    with KVCacheClient(cluster.redis_url, ns, timeout=5) as unstated:
        assert unstated.lookup(tokens) == 0
    with pytest.raises(InvalidInputError, match="contradicts the namespace's weights"):
        KVCacheClient(
            cluster.redis_url, ns.model_copy(update={"weights": "a"}), weights_revision="b"
        )
    # an empty weights field keeps the namespace's digest (golden vectors unchanged)
    assert (
        ns.model_copy(update={"weights": ""}).digest
        == ns.digest
        != ns.model_copy(update={"weights": "a"}).digest
    )
