"""Hash format: golden vectors pin the bytes; properties pin the prefix semantics."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore import (
    InvalidInputError,
    Namespace,
    block_hash_bytes,
    block_hashes,
    part_hashes,
    sequence_hash,
)
from kvstore.pages.hashing import reference_block_hashes

GOLDEN_NS = Namespace(
    model="golden/llama", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64, block_size=4
)


def test_golden_namespace_digest():
    assert GOLDEN_NS.canonical_json() == (
        '{"block_size":4,"dtype":"bfloat16","format_version":1,"head_size":64,"hidden_size":0,'
        '"layout":"kv_lbhd","model":"golden/llama","num_kv_heads":2,"num_layers":4,"pp_rank":0,'
        '"tenant":"default","tp_rank":0,"tp_size":1}'
    )
    assert GOLDEN_NS.digest_hex == "bd7cf7c9a57abbf9b8ca5531f78e27da"


def test_golden_block_sequence_and_part_hashes():
    hashes = block_hashes(GOLDEN_NS, list(range(10)))
    assert [h.hex() for h in hashes] == [
        "6d59d525a5e319f519388e3944063b8a",
        "6f9f53b6b606d9a02c411df77a2e38cd",
    ]
    seq = sequence_hash(GOLDEN_NS, list(range(10)))
    assert seq.hex() == "4f8cd3af4dc518b46248b0f1e19ddb11"
    assert part_hashes(seq, 2)[1].hex() == "47d2b429281f6132e34d27d94e65ac63"
    assert sequence_hash(GOLDEN_NS, [7, 8]).hex() == "b21d582a8357d4ead235608ebb2b383e"


def test_block_hash_matches_documented_construction():
    tokens = np.arange(8, dtype="<u4")
    first = hashlib.blake2b(
        GOLDEN_NS.digest + bytes(16) + tokens[:4].tobytes(), digest_size=16, person=b"kvs-block-v1"
    ).digest()
    second = hashlib.blake2b(
        GOLDEN_NS.digest + first + tokens[4:].tobytes(), digest_size=16, person=b"kvs-block-v1"
    ).digest()
    assert block_hashes(GOLDEN_NS, tokens) == [first, second]


# 24 tokens make the hashed message exactly one 128-byte BLAKE2b block; 25 spill one byte.
@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16, 23, 24, 25, 64, 256]),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=600),
)
def test_c_chain_equals_hashlib_construction(block_size, tokens):
    ns = Namespace(
        model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, block_size=block_size
    )
    expected = reference_block_hashes(ns, tokens)
    assert block_hashes(ns, tokens) == expected
    assert block_hash_bytes(ns, tokens) == b"".join(expected)


def test_split_hashes_undoes_the_join_and_refuses_a_partial_hash():
    from kvstore.pages._chainhash import split_hashes

    hashes = block_hashes(GOLDEN_NS, list(range(12)))
    assert split_hashes(b"".join(hashes)) == hashes and split_hashes(b"") == []
    with pytest.raises(ValueError, match="17 bytes is not a whole number of 16-byte hashes"):
        split_hashes(bytes(17))


@pytest.mark.process
def test_hashes_do_not_depend_on_pythonhashseed():
    code = "import sys; from kvstore import Namespace, block_hashes; print(block_hashes(Namespace.model_validate_json(sys.argv[1]), list(range(12)))[-1].hex())"
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code, GOLDEN_NS.model_dump_json()],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    assert len(outs) == 1


def test_token_containers_agree():
    tokens = [5, 9, 2, 7, 1, 1, 0, 3]
    expected = block_hashes(GOLDEN_NS, tokens)
    assert block_hashes(GOLDEN_NS, np.array(tokens, dtype=np.int64)) == expected
    assert block_hashes(GOLDEN_NS, torch.tensor(tokens)) == expected
    assert block_hashes(GOLDEN_NS, tuple(tokens)) == expected
    assert (
        block_hashes(GOLDEN_NS, [np.int64(t) for t in tokens]) == expected
    )  # not plain ints: through numpy


# a bad id in the first block, in a later one, and in a trailing partial block (no hash,
# still checked)
@pytest.mark.parametrize(
    "bad",
    [
        [1, -1, 2, 3],
        [1, 2**32, 2, 3],
        [1.5, 2, 3, 4],
        ["a", 1, 2, 3],
        [0, 1, 2, 3, 4, 5, 2**40, 7],
        [0, 1, 2, 3, 4, -5],
        [0, 1, 2, 3, 4, None],
    ],
)
def test_bad_token_lists_are_refused_by_name(bad):
    for tokens in (bad, tuple(bad)):
        with pytest.raises(InvalidInputError, match="token ids"):
            block_hashes(GOLDEN_NS, tokens)
        with pytest.raises(InvalidInputError, match="token ids"):
            block_hash_bytes(GOLDEN_NS, tokens)


def test_the_chain_names_the_bad_token_of_a_list_it_hashes_block_by_block():
    from kvstore.pages._chainhash import chain

    good = list(range(10))  # two blocks of 4 and a partial one
    assert chain(GOLDEN_NS.digest, good, 16, b"kvs-block-v1", bytes(16)) == block_hash_bytes(
        GOLDEN_NS, np.array(good)
    )
    with pytest.raises(OverflowError, match="token 5 does not fit in uint32"):
        chain(GOLDEN_NS.digest, good[:5] + [2**32] + good[6:], 16, b"kvs-block-v1", bytes(16))
    with pytest.raises(TypeError, match="token 9 is str, not an int"):
        chain(GOLDEN_NS.digest, good[:9] + ["x"], 16, b"kvs-block-v1", bytes(16))


class _Id(int):
    """An int subclass: uint32_le reads exact ints in place and must not skip the
    general path for anything else."""


# the edges of CPython's one-digit ints (2**30) and of uint32 (2**32), on both sides
@example(tokens=[0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1], as_tuple=False)
@example(tokens=[2**32 - 1, 2**32], as_tuple=True)
@example(tokens=[5, -1], as_tuple=False)
@example(tokens=[-(2**30)], as_tuple=False)
@example(tokens=[True, _Id(7), _Id(2**31)], as_tuple=False)
@given(
    tokens=st.lists(st.one_of(st.integers(-(2**40), 2**40), st.booleans()), max_size=50),
    as_tuple=st.booleans(),
)
def test_the_c_token_conversion_agrees_with_array_array(tokens, as_tuple):
    """kvstore.pages._chainhash.uint32_le, which token_array uses for lists, gives array.array's
    bytes for every list it accepts and refuses exactly the lists it refuses."""
    import array

    from kvstore.pages._chainhash import uint32_le

    given_ = tuple(tokens) if as_tuple else tokens
    try:
        expected = array.array("I", given_).tobytes()
    except OverflowError:
        with pytest.raises(OverflowError):
            uint32_le(given_)
        return
    assert uint32_le(given_) == expected


@given(
    items=st.lists(
        st.one_of(
            st.binary(min_size=15, max_size=17),
            st.binary(min_size=16, max_size=16).map(bytearray),
            st.integers(),
            st.none(),
        ),
        max_size=20,
    ),
    as_tuple=st.booleans(),
)
def test_the_c_hash_join_agrees_with_a_checked_join(items, as_tuple):
    """kvstore.pages._chainhash.join_hashes, which every index call uses on its page hashes,
    joins exactly the lists whose items are all 16-byte bytes or bytearrays, and
    otherwise names the first item that is not."""
    from kvstore.pages._chainhash import join_hashes

    given_ = tuple(items) if as_tuple else items
    bad = next(
        (i for i, h in enumerate(items) if not isinstance(h, (bytes, bytearray)) or len(h) != 16),
        None,
    )
    assert join_hashes(given_) == (b"".join(items) if bad is None else bad)


tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(common=tokens_st, a=tokens_st, b=tokens_st)
def test_shared_prefix_shares_exactly_k_block_hashes(common, a, b):
    ns = GOLDEN_NS
    ta, tb = common + a, common + b
    ha, hb = block_hashes(ns, ta), block_hashes(ns, tb)
    # k = number of full blocks on which the two lists agree token for token
    k = 0
    while k < min(len(ha), len(hb)) and ta[k * 4 : k * 4 + 4] == tb[k * 4 : k * 4 + 4]:
        k += 1
    assert ha[:k] == hb[:k]
    if k < min(len(ha), len(hb)):
        assert all(x != y for x, y in zip(ha[k:], hb[k:]))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=4, max_size=40),
    pos=st.integers(0, 39),
    delta=st.integers(1, 5),
)
def test_changing_a_token_changes_its_block_and_all_later(tokens, pos, delta):
    pos %= len(tokens)
    changed = list(tokens)
    changed[pos] += delta
    before, after = block_hashes(GOLDEN_NS, tokens), block_hashes(GOLDEN_NS, changed)
    block = pos // 4
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:]))
    assert sequence_hash(GOLDEN_NS, tokens) != sequence_hash(GOLDEN_NS, changed)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=4, max_size=16),
    field=st.sampled_from(
        ["model", "dtype", "num_layers", "tp_rank", "tenant", "layout", "block_size"]
    ),
)
def test_different_namespaces_never_share_a_hash(tokens, field):
    changes = {
        "model": "other",
        "dtype": "float16",
        "num_layers": 5,
        "tp_rank": 1,
        "tenant": "t2",
        "layout": "vllm_cpu",
        "block_size": 2,
    }
    extra = {"tp_size": 2} if field == "tp_rank" else {}
    other = GOLDEN_NS.model_copy(update={field: changes[field], **extra})
    other = Namespace.model_validate(other.model_dump())
    assert other.digest != GOLDEN_NS.digest
    assert not set(block_hashes(GOLDEN_NS, tokens)) & set(block_hashes(other, tokens))
    assert sequence_hash(GOLDEN_NS, tokens) != sequence_hash(other, tokens)


def test_sequence_hash_distinguishes_length_and_partial_tokens():
    assert sequence_hash(GOLDEN_NS, [1, 2, 3, 4]) != sequence_hash(GOLDEN_NS, [1, 2, 3, 4, 0])
    assert sequence_hash(GOLDEN_NS, [1, 2, 3, 4, 5]) != sequence_hash(GOLDEN_NS, [1, 2, 3, 4, 6])
    assert sequence_hash(GOLDEN_NS, []) != sequence_hash(GOLDEN_NS, [0])


@pytest.mark.parametrize(
    "bad, message",
    [([[1, 2], [3, 4]], "1-D"), ([1.5, 2.0], "integers"), ([-1, 2], "lie in"), ([2**32], "lie in")],
)
def test_bad_tokens_are_rejected_with_a_clear_message(bad, message):
    with pytest.raises(InvalidInputError, match=message):
        block_hashes(GOLDEN_NS, np.array(bad))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": "float64"}, "unsupported dtype"),
        ({"layout": "nhd"}, "unknown page layout"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank 2 must be below"),
        ({"block_size": 0}, "greater than 0"),
    ],
)
def test_bad_namespace_fields_are_rejected(fields, message):
    base = GOLDEN_NS.model_dump()
    base.update(fields)
    with pytest.raises(ValueError, match=message):
        Namespace(**base)


def test_namespace_is_frozen():
    with pytest.raises(ValueError):
        GOLDEN_NS.model = "x"
