"""Keyed pages: pages named by an engine's own chained page keys (SGLang's HiCache)
rather than token ids. Their hash format (golden vector), their one-page index
segments, the layouts that carry them, the SGLang backend's options and its side pools'
hit policies. The
backend's work against real nodes is tests/sglang/test_sglang_hicache.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.sglang.options import hicache_options
from client.sglang.restorable import ALL_PAGES, TRAILING_PAGES, restorable_ends
from kvstore.errors import InvalidInputError
from kvstore.pages import keys
from kvstore.pages.hashing import keyed_hash_bytes
from kvstore.pages.layouts import LAYOUTS, detect_layout
from kvstore.pages.namespace import Namespace

NS = Namespace(
    model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=8, block_size=4,
    layout="sglang_2blhd",
)  # fmt: skip


def test_golden_keyed_hashes():
    """The bytes of a keyed page's hash never change: stored pages stay found."""
    assert NS.digest_hex == "a8995fb8071913ce89fb1132b5341962"
    assert keyed_hash_bytes(NS, ["a" * 64, "page-key"]).hex() == (
        "38a94b5ccb6cdc0ef5f85ffd991470259b810543fa9fcc830ed8305c85f8bb97"
    )
    for key in ("page-key", "k" * 300, "ключ"):  # one BLAKE2b block, three, not ASCII
        want = hashlib.blake2b(NS.digest + key.encode(), digest_size=16, person=b"kvs-key-v1")
        assert keyed_hash_bytes(NS, [key]) == want.digest()


def test_a_key_names_different_pages_in_different_namespaces():
    tenant = NS.model_copy(update={"tenant": "someone-else"})
    model = NS.model_copy(update={"model": "other"})
    mla = NS.model_copy(update={"layout": "sglang_mla_blhd", "num_kv_heads": 1})
    tp2 = NS.model_copy(update={"tp_rank": 1, "tp_size": 2}).storage  # what a TP=2 rank hashes with
    spaces = (NS, tenant, model, mla, tp2)
    assert len({keyed_hash_bytes(ns, ["k"]) for ns in spaces}) == len(spaces)


def test_keyed_hashes_refuse_token_layouts_and_empty_keys():
    assert NS.keyed and not NS.model_copy(update={"layout": "vllm_cpu"}).keyed
    with pytest.raises(InvalidInputError, match="keys pages by token ids"):
        keyed_hash_bytes(NS.model_copy(update={"layout": "vllm_cpu"}), ["k"])
    with pytest.raises(InvalidInputError, match="non-empty string that UTF-8 can hold, got ''"):
        keyed_hash_bytes(NS, ["k", ""])
    with pytest.raises(InvalidInputError, match="got 3"):
        keyed_hash_bytes(NS, ["k", 3])
    with pytest.raises(InvalidInputError, match="UTF-8"):
        keyed_hash_bytes(NS, ["k", "a\ud800"])


def test_keyed_pages_without_a_position_are_each_their_own_segment():
    """A keyed page asked with no chain position anchors its own segment: a lookup from
    any key of a stored chain reads the same segments its put wrote."""
    assert keys.segments(3, span=1) == [(0, 1), (1, 2), (2, 3)]
    assert keys.segments(3) == [(0, 3)]
    hashes = [bytes([i]) * 16 for i in range(130)]
    assert keys.placement(hashes, span=1) == (hashes, [0] * 130)
    anchors, positions = keys.placement(hashes)
    assert anchors[63] == hashes[0] and anchors[64] == hashes[64] and positions[65] == 1


def test_a_chain_placed_from_its_middle_lies_where_the_whole_chain_does():
    """Keys asked from chain position 100 (SGLang's prefix_keys give it) lie in the
    same segments, at the same positions, as when the chain is placed from 0."""
    hashes = [bytes([i]) * 16 for i in range(200)]
    whole = keys.placement(hashes)
    tail = keys.placement(hashes[100:], offset=100 % 64, head_anchor=hashes[64])
    assert tail == (whole[0][100:], whole[1][100:])
    assert keys.segments(100, offset=36) == [(0, 28), (28, 92), (92, 100)]
    with pytest.raises(ValueError, match="head_anchor"):
        keys.placement(hashes, offset=3)


def test_sglang_layouts_are_never_detected_from_an_engines_cache():
    """They describe SGLang's host pool pages, not any engine's paged cache tensor."""
    keyed = [name for name, layout in LAYOUTS.items() if layout.keyed]
    assert len(keyed) == 7 and all(not LAYOUTS[n].cache_dims for n in keyed)
    assert detect_layout((10, 2, 4, 16), 4, 2, 8) == "vllm_cpu"


def test_hicache_options_skip_sglangs_keys_and_name_a_typo(monkeypatch):
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis://127.0.0.1:7000")
    monkeypatch.setenv("KVSTORE_TIMEOUT", "3")
    sglang = {"backend_name": "kvstore", "module_path": "client.sglang", "interface_v1": 1}
    ours, client = hicache_options({**sglang, "tenant": "team-a", "timeout": 1.5})
    assert ours.tenant == "team-a" and ours.model is None
    assert client.timeout == 1.5  # the extra config wins over the environment
    assert client.redis_url == "redis://127.0.0.1:7000"  # unset ones come from KVSTORE_*
    with pytest.raises(InvalidInputError, match="unknown key 'replica' .*'replicas'"):
        hicache_options({**sglang, "replica": 2})
    with pytest.raises(InvalidInputError, match="tenant='a/b'"):
        hicache_options({"tenant": "a/b"})


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 6))
def test_side_pool_restorable_lengths_follow_sglangs_hit_policies(present, window):
    """A prefix length is restorable under trailing_pages when the pool holds the
    ``window`` pages before it (fewer for a shorter prefix), under all_pages when it
    holds every page up to it, as SGLang's own backends read the policies."""
    n = len(present)
    trailing = [p for p in range(1, n + 1) if all(present[max(0, p - window) : p])]
    assert restorable_ends(present, TRAILING_PAGES, window) == trailing
    every = [p for p in range(1, n + 1) if all(present[:p])]
    assert restorable_ends(present, ALL_PAGES, window) == every
    assert restorable_ends(present, "block_groups", window) == []


def test_a_mamba_states_restorable_lengths_are_where_states_lie():
    """States after pages 3 and 7 of 8 (SGLang backs one up where a node ends): lengths 4
    and 8 are restorable, 6 is not; a 2-page window needs both pages before it."""
    present = [i in (3, 7) for i in range(8)]
    assert restorable_ends(present, TRAILING_PAGES, 1) == [4, 8]
    assert restorable_ends([i in (6, 7) for i in range(8)], TRAILING_PAGES, 2) == [8]


@st.composite
def _one_page_segments(draw):
    """The values of one-page segments as an index holds them (None: no segment),
    their entries' hashes the one asked there, another page's, or a unit of it."""
    from kvstore.index.records import ENTRY

    n = draw(st.integers(1, 12))
    asked = np.frombuffer(draw(st.binary(min_size=16 * n, max_size=16 * n)), dtype="<u8")
    values = []
    for i in range(n):
        if draw(st.booleans()) and draw(st.booleans()):
            values.append(None)
            continue
        recs = np.zeros(draw(st.integers(0, 3)), dtype=ENTRY)
        for r in recs:
            kind = draw(st.sampled_from(["same", "unit", "other"]))
            r["h0"] = asked[2 * i] if kind != "other" else asked[2 * i] ^ 1
            r["h1"] = asked[2 * i + 1] ^ (draw(st.integers(1, 3)) if kind == "unit" else 0)
            r["pos"] = draw(st.sampled_from([0, 0, 5]))
            r["node"] = draw(st.integers(0, 3))
        values.append(recs.tobytes())
    return asked.tobytes(), values


@given(_one_page_segments(), st.sampled_from([(0, 1), (1, 2)]), st.booleans())
def test_one_page_segments_read_by_mget_pick_what_the_script_picks(case, units, sparse):
    """The MGET path's picking (``_pick_pages``: every value, None where a segment is
    missing) keeps exactly the entries the lookup script's path keeps (``_pick`` over
    the segments the script returns: up to the first missing one, or each on its own
    when sparse)."""
    from kvstore.index.entry_picks import pick as _pick
    from kvstore.index.entry_picks import pick_pages as _pick_pages
    from kvstore.index.records import ENTRY

    blob, values = case
    n = len(values)
    segs = [(i, i + 1) for i in range(n)]
    # the script path's replies: per segment read, its number, entry count and entries
    # (sparse: a GET each, a missing one an empty reply; else up to the first missing)
    contiguous = n if sparse else next((i for i, v in enumerate(values) if v is None), n)
    parts = [
        ([i], [len(v) // ENTRY.itemsize], v) if v is not None else ([], [], b"")
        for i, v in enumerate(values[:contiguous])
    ]
    want = _pick(blob, segs, parts, contiguous, None, *units)
    got = _pick_pages(blob, values, *units, sparse)
    assert got.covered == want.covered
    assert got.records.tobytes() == want.records.tobytes()
    assert got.positions.tolist() == want.positions.tolist()
    assert got.units.tolist() == want.units.tolist()


def test_one_page_segment_names_and_commands_are_what_the_index_reads():
    """The C helpers of the MGET path: each name is the segment key the lookup script
    builds for that anchor (``keys.segment_key``), a blob of no whole hashes is refused;
    a held connection's commands (``_resp.pack``) are the bytes redis-py packs, and an
    argument of another type is left to redis-py."""
    import os

    import redis

    from kvstore.index._resp import pack
    from kvstore.pages._chainhash import hex_names

    prefix, blob = "kvs:t:team:ab12:", os.urandom(16 * 5)
    names = hex_names(f"{prefix}s:{{".encode(), blob, b"}")
    assert names == [keys.segment_key(prefix, blob[i : i + 16]).encode() for i in range(0, 80, 16)]
    with pytest.raises(ValueError, match="17 bytes is not a whole number"):
        hex_names(b"p", blob[:17], b"}")
    conn = redis.Redis().connection_pool.make_connection()
    for command in [
        ("MGET", *names),
        ("PING",),
        ("EVALSHA", "ab" * 20, 1, "kvs:k", 5000, -1, 0, "é", b"\x00\r\n"),
        ("SET", "x" * 12345, 10**20),
    ]:
        assert pack(command) == b"".join(conn.pack_commands([command])), command[:2]
    assert pack(("SET", "k", 1.5)) is None and pack(("SET", "k", True)) is None
