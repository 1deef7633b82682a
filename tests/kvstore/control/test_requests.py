"""The control API's bodies (kvstore/control/requests.py): what is accepted, and that a
refused body's error names the field at fault (the node answers it in a 400, the
CLI and the client in one line)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvstore.control.requests import (
    MAX_PIN_TTL_S,
    ClearRequest,
    PinRequest,
    PrefixRequest,
)
from kvstore.errors import first_problem

HASH = "0123456789abcdef0123456789abcdef"


def problem(kind, **fields) -> tuple[str, str]:
    """The field and message of the first problem of ``kind(**fields)``."""
    with pytest.raises(ValidationError) as exc:
        kind(**fields)
    where, _, message = first_problem(exc.value)
    return where, message


def test_both_forms_of_a_prefix_are_accepted():
    tokens = PinRequest(model="m", token_ids=[1, 2, 3], ttl_s=30, lora_name="a", cache_salt="s")
    assert tokens.has_prefix and tokens.ttl_s == 30 and tokens.tenant == "default"
    hashes = PrefixRequest(namespace=HASH, block_hashes=[HASH, HASH], tenant="team-a")
    assert hashes.has_prefix and hashes.model is None
    assert PrefixRequest(model="m", block_hashes=[HASH]).has_prefix


def test_clear_takes_a_prefix_a_namespace_a_model_or_the_whole_tenant():
    assert not ClearRequest(tenant="team-a").has_prefix
    assert ClearRequest(tenant="team-a", namespace=HASH).namespace == HASH
    assert ClearRequest(tenant="team-a", model="m").model == "m"
    assert ClearRequest(tenant="team-a", namespace=HASH, block_hashes=[HASH]).has_prefix


@pytest.mark.parametrize(
    ("kind", "fields", "field", "words"),
    [
        (PinRequest, {"model": "m", "token_ids": [1], "ttl_s": 0}, "ttl_s", "greater than 0"),
        (PinRequest, {"model": "m", "token_ids": [1], "ttl_s": MAX_PIN_TTL_S * 2}, "ttl_s", "less"),
        (PrefixRequest, {"model": "m", "token_ids": []}, "token_ids", "at least 1"),
        (PrefixRequest, {"namespace": HASH, "block_hashes": []}, "block_hashes", "at least 1"),
        (PrefixRequest, {"namespace": "ABC", "block_hashes": [HASH]}, "namespace", "pattern"),
        (PrefixRequest, {"tenant": "a b", "model": "m", "token_ids": [1]}, "tenant", "pattern"),
        (PrefixRequest, {"model": "", "token_ids": [1]}, "model", "at least 1"),
        (PrefixRequest, {"model": "m", "token_ids": [1], "block_size": 0}, "block_size", "greater"),
        (PrefixRequest, {"model": "m", "token_ids": [1], "lora_name": ""}, "lora_name", "at least"),
        (
            PrefixRequest,
            {"model": "m", "token_ids": [1], "cache_salt": ""},
            "cache_salt",
            "at least",
        ),
        (PrefixRequest, {"model": "m", "token_ids": ["x"]}, "token_ids.0", "integer"),
        (PrefixRequest, {"model": "m", "token_ids": [1], "ttl": 3}, "ttl", "not permitted"),
        (ClearRequest, {"tenant": "t", "pages": 3}, "pages", "not permitted"),
    ],
)
def test_a_field_out_of_range_is_named(kind, fields, field, words):
    where, message = problem(kind, **fields)
    assert where == field and words in message, (where, message)


@pytest.mark.parametrize(
    ("kind", "fields", "words"),
    [
        (PrefixRequest, {"tenant": "t"}, "give the prefix: token_ids (with model) or block_hashes"),
        (PinRequest, {"model": "m"}, "give the prefix"),
        (PrefixRequest, {"token_ids": [1, 2]}, "token_ids need model"),
        (PrefixRequest, {"model": "m", "token_ids": [2**32]}, "token ids must lie in [0, 2**32)"),
        (PrefixRequest, {"model": "m", "token_ids": [-1]}, "token ids must lie"),
        (PrefixRequest, {"block_hashes": [HASH]}, "block_hashes need namespace"),
        (PrefixRequest, {"namespace": HASH, "block_hashes": [HASH.upper()]}, "block_hashes are 32"),
        (PrefixRequest, {"namespace": HASH, "block_hashes": ["ab"]}, "block_hashes are 32"),
        (
            ClearRequest,
            {"model": "m", "token_ids": [1], "block_hashes": [HASH]},
            "token_ids or block_hashes, not both",
        ),
    ],
)
def test_a_body_that_does_not_hold_together_names_the_fields(kind, fields, words):
    where, message = problem(kind, **fields)
    assert where == "" and words in message, (where, message)


def test_bodies_are_read_as_the_node_reads_them():
    body = PinRequest(namespace=HASH, block_hashes=[HASH], ttl_s=5).model_dump_json(
        exclude_none=True
    )
    assert PinRequest.model_validate_json(body).ttl_s == 5
    with pytest.raises(ValidationError):
        PrefixRequest.model_validate_json(body)  # ttl_s is a pin's alone
