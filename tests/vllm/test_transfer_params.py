"""A request's kv_transfer_params as the connector reads them (client.vllm.transfer_params):
the pin of what it saves (``kvstore_pin``), the prefix fingerprint a P/D announcement
carries, and the decode worker's wait for an announced prefix (client.paging.awaiting),
without an engine or a store."""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from concurrent.futures import Future

import pytest

from client.paging.awaiting import POLL_MAX_S, PrefixWaiter, Waited
from client.paging.loader import LoadOutcome
from client.paging.specs import AwaitedLoad
from kvstore.pages.hashing import prefix_fingerprint
from kvstore.pages.identity import NO_EXTRAS, BlockExtras

pytest.importorskip("vllm")  # client.vllm's modules import vLLM's types

from client.vllm.pins import PinSpec, pin_of
from client.vllm.transfer_params import (
    UNUSABLE,
    Announced,
    PinAsk,
    announced,
    announcement,
    pin_request,
    wants_remote_decode,
)

BS = 16
PROMPT = list(range(100, 100 + 5 * BS + 3))  # 5 full blocks
SALTED = BlockExtras(((0, b"s" * 16), (4, b"t" * 16)))


def test_the_fingerprint_is_the_documented_blake2b_of_size_tokens_and_extras():
    tokens = PROMPT[: 5 * BS]
    h = hashlib.blake2b(digest_size=16, person=b"kvs-prefix-v1")
    h.update(struct.pack("<I", BS) + struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(struct.pack("<I", 0) + b"s" * 16 + struct.pack("<I", 4) + b"t" * 16)
    assert prefix_fingerprint(BS, tokens, SALTED) == h.digest()
    # an extra past the prefix's blocks is not part of it; one inside is
    assert prefix_fingerprint(BS, tokens[: 4 * BS], SALTED) == prefix_fingerprint(
        BS, tokens[: 4 * BS], BlockExtras(((0, b"s" * 16),))
    )
    assert prefix_fingerprint(BS, tokens, SALTED) != prefix_fingerprint(BS, tokens, NO_EXTRAS)
    assert prefix_fingerprint(BS, tokens, NO_EXTRAS) != prefix_fingerprint(2 * BS, tokens)


def test_a_prefill_announces_what_a_decode_of_the_same_prompt_waits_for():
    params = announcement(BS, PROMPT, SALTED, 5)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert announced(params, BS, PROMPT, SALTED, "r") == Announced(5)
    # vLLM adds keys of its own on the way; the proxy passes them all on
    assert announced({**params, "remote_prefill_cached_tokens": 32}, BS, PROMPT, SALTED, "r") == (
        Announced(5)
    )
    assert wants_remote_decode({"do_remote_decode": True})
    assert not wants_remote_decode({"do_remote_decode": "yes"}) and not wants_remote_decode(None)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"kvstore_blocks": "5"}, "kvstore_blocks must be a count"),
        ({"kvstore_blocks": True}, "kvstore_blocks must be a count"),
        ({"kvstore_blocks": -1}, "kvstore_blocks must be a count"),
        ({"kvstore_prefix": None}, "kvstore_prefix must be a hex string"),
        ({"kvstore_block_size": 32}, "block size 32 is not this engine's 16"),
        ({"kvstore_blocks": 6}, "6 blocks announced, the prompt has 5"),
        ({"kvstore_prefix": "00" * 16}, "another prompt or identity"),
    ],
)
def test_params_a_decode_cannot_wait_for_are_named_and_looked_up(change, reason, caplog):
    caplog.set_level(logging.DEBUG, logger="client.vllm.transfer_params")  # repeats: DEBUG
    params = {**announcement(BS, PROMPT, SALTED, 5), **change}
    assert announced(params, BS, PROMPT, SALTED, "req-9") is UNUSABLE
    assert any("req-9" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_params_of_another_identity_or_of_no_handoff_are_not_waited_for():
    params = announcement(BS, PROMPT, SALTED, 5)
    assert announced(params, BS, PROMPT, NO_EXTRAS, "r") is UNUSABLE  # another salt
    assert announced(None, BS, PROMPT, NO_EXTRAS, "r") is None
    assert announced({"do_remote_decode": True}, BS, PROMPT, NO_EXTRAS, "r") is None
    nixl = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    assert announced(nixl, BS, PROMPT, NO_EXTRAS, "r") is None  # another connector's


@pytest.mark.parametrize(
    ("params", "ask"),
    [
        (None, None),
        ({}, None),
        ({"kvstore_pin": False}, None),
        ({"kvstore_pin": None}, None),
        ({"kvstore_pin": True}, PinAsk()),
        ({"kvstore_pin": {}}, PinAsk()),
        ({"kvstore_pin": {"ttl_s": 600}}, PinAsk(ttl_s=600.0)),
        ({"kvstore_pin": {"ttl_s": 0.5, "tokens": 40}}, PinAsk(0.5, 40)),
        ({"kvstore_pin": {"ttl_s": None, "tokens": None}}, PinAsk()),
    ],
)
def test_a_pin_is_asked_for_with_true_or_an_object_of_ttl_and_tokens(params, ask, caplog):
    caplog.set_level(logging.WARNING, logger="client.vllm.transfer_params")
    assert pin_request(params, "req-1") == ask
    assert not caplog.records


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("yes", "must be true, false or"),
        (1, "must be true, false or"),
        ([600], "must be true, false or"),
        ({"ttl": 600}, "unknown key(s) ttl"),
        ({"ttl_s": 600, "blocks": 2}, "unknown key(s) blocks"),
        ({"ttl_s": 0}, "ttl_s must be seconds"),
        ({"ttl_s": -5}, "ttl_s must be seconds"),
        ({"ttl_s": "600"}, "ttl_s must be seconds"),
        ({"ttl_s": True}, "ttl_s must be seconds"),
        ({"ttl_s": float("nan")}, "ttl_s must be seconds"),
        ({"ttl_s": 10 * 365 * 24 * 3600}, "ttl_s must be seconds"),
        ({"tokens": 0}, "tokens must be a count"),
        ({"tokens": 12.5}, "tokens must be a count"),
        ({"tokens": False}, "tokens must be a count"),
    ],
)
def test_a_bad_pin_is_named_with_its_request_and_nothing_is_pinned(value, reason, caplog):
    """The request still runs (nothing raises): only the pin is left out, since a
    mistyped TTL must not pin for ever."""
    caplog.set_level(logging.WARNING, logger="client.vllm.transfer_params")
    assert pin_request({"kvstore_pin": value}, "req-7") is None
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "req-7" in message and "'kvstore_pin'" in message and reason in message
    assert "not pinned" in message


def test_a_pin_names_the_full_blocks_within_its_tokens_of_what_is_stored(caplog):
    """``tokens`` rounds down to whole blocks (the block holding the system prompt's end
    holds the user's first words too) and never passes what the save stores."""
    stored = len(PROMPT) // BS  # 5
    whole = pin_of("r", PinAsk(ttl_s=60.0), PROMPT, SALTED, BS, stored)
    assert whole == PinSpec("r", PROMPT[: 5 * BS], SALTED, 60.0)
    assert pin_of("r", PinAsk(tokens=2 * BS + 7), PROMPT, SALTED, BS, stored) == PinSpec(
        "r", PROMPT[: 2 * BS], SALTED, None
    )
    assert pin_of("r", PinAsk(tokens=10_000), PROMPT, NO_EXTRAS, BS, stored) == PinSpec(
        "r", PROMPT[: 5 * BS], NO_EXTRAS, None
    )
    caplog.set_level(logging.WARNING, logger="client.vllm.pins")
    assert pin_of("short", PinAsk(tokens=BS - 1), PROMPT, NO_EXTRAS, BS, stored) is None
    assert "short" in caplog.text and "no full block" in caplog.text


class _Prefix:
    """What the waiter reads of a StoredPrefix: its blocks."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks


def _load(req_id: str, blocks: int, wait_s: float) -> AwaitedLoad:
    return AwaitedLoad(
        req_id, PROMPT[: blocks * BS], NO_EXTRAS, list(range(1, blocks + 1)), 0, wait_s
    )


def _waiter(stored: dict[int, int], ended: dict[str, tuple[int, Waited]]) -> PrefixWaiter:
    """A waiter over ``stored`` (a prefix's length in tokens -> blocks of it stored now),
    recording how each wait ended in ``ended``."""

    def start(load: AwaitedLoad, found, waited: Waited) -> Future[LoadOutcome]:
        ended[load.req_id] = (found.blocks if found is not None else -1, waited)
        done: Future[LoadOutcome] = Future()
        done.set_result(LoadOutcome([], 0, waited.seconds))
        return done

    return PrefixWaiter(lambda tokens, extras, timeout: _Prefix(stored[len(tokens)]), start)


def test_a_wait_ends_when_the_prefix_is_stored_and_another_at_its_deadline():
    stored = {3 * BS: 1, 2 * BS: 0}  # "soon" has 3 blocks, "never" 2
    ended: dict[str, tuple[int, Waited]] = {}
    waiter = _waiter(stored, ended)
    try:
        started = time.monotonic()
        soon = waiter.add(_load("soon", 3, 5.0))
        never = waiter.add(_load("never", 2, 0.3))
        threading.Timer(0.2, stored.__setitem__, (3 * BS, 3)).start()
        soon.result(timeout=2)
        assert time.monotonic() - started < 0.2 + POLL_MAX_S + 0.1
        never.result(timeout=2)
    finally:
        waiter.close()
    found, waited = ended["soon"]
    assert found == 3 and waited.in_time and 0.2 <= waited.seconds < 0.2 + POLL_MAX_S + 0.1
    assert waited.lookups <= 3 + 0.2 / POLL_MAX_S + 2  # backing off, not spinning
    found, waited = ended["never"]
    assert found == 0 and not waited.in_time and 0.3 <= waited.seconds < 0.5


def test_closing_the_waiter_ends_every_wait_at_once():
    ended: dict[str, tuple[int, Waited]] = {}
    waiter = _waiter({BS: 0}, ended)
    pending = waiter.add(_load("x", 1, 60.0))
    time.sleep(0.05)
    started = time.monotonic()
    waiter.close()
    pending.result(timeout=2)
    assert time.monotonic() - started < 1 and not ended["x"][1].in_time
