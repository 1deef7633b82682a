"""What a request's ``kv_transfer_params`` say to the connector: the per-request switches
(``kvstore_load``, ``kvstore_save``), the pin of what it saves (``kvstore_pin``,
``pin_request``), and the P/D handoff's announcement.

The handoff follows vLLM's P/D convention, so proxies written for vLLM's NIXL and
Mooncake connectors (vLLM's ``disaggregated_serving`` examples, llm-d's routing sidecar)
drive it unchanged: the proxy sends the prefill ``{"do_remote_decode": true}``, the
prefill's response carries the params ``request_finished`` returns, and the proxy passes
them verbatim to the decode. kvstore's params name what the prefill's save publishes:

- ``do_remote_prefill``: true (vLLM's own key: the decode's KV comes from elsewhere);
- ``kvstore_blocks``: the full blocks of the prompt the prefill's save stores;
- ``kvstore_block_size``: the prefill engine's block size;
- ``kvstore_prefix``: ``kvstore.pages.hashing.prefix_fingerprint`` of those blocks'
  tokens and the request's identity (LoRA, salt, multimodal items, embeddings), hex.

The decode that reads them claims those blocks at once (``(tokens, True)``, no index
lookup, so ``lookup_budget_ms`` cannot turn them into a recompute) and its workers
wait for the pages (``client.paging.awaiting``), at most ``remote_prefill_wait_ms``.
Params it cannot use (another block size, another prompt or identity, malformed) are
counted, logged, and the request is looked up as any other."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from client.log_limit import LogLimit
from kvstore.control.requests import MAX_PIN_TTL_S
from kvstore.pages.hashing import prefix_fingerprint
from kvstore.pages.identity import BlockExtras

log = logging.getLogger(__name__)
_LIMIT = LogLimit(log)


def request_switch(params: dict[str, Any] | None, name: str, req_id: str) -> bool:
    """A per-request switch (``kvstore_load``, ``kvstore_save``) from the request's
    ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``):
    on unless set to False. A value that is not a boolean is logged as an error naming
    the request and the key, and the switch stays on: raising here would stop the
    scheduler, and so every other request."""
    if not isinstance(params, dict) or name not in params:
        return True
    value = params[name]
    if isinstance(value, bool):
        return value
    log.error(
        "request %s: kv_transfer_params[%r] must be true or false, got %r; left on",
        req_id,
        name,
        value,
    )
    return True


PIN_PARAM = "kvstore_pin"
_PIN_KEYS = frozenset({"ttl_s", "tokens"})


@dataclass(frozen=True)
class PinAsk:
    """A request's ``kvstore_pin``: keep the full blocks of its prompt's first ``tokens``
    tokens (None: the whole prompt) in the storage nodes' memory once they are stored,
    for ``ttl_s`` seconds (None: until unpinned)."""

    ttl_s: float | None = None
    tokens: int | None = None


def pin_request(params: dict[str, Any] | None, req_id: str) -> PinAsk | None:
    """The pin a request's ``kv_transfer_params`` ask for: ``"kvstore_pin": true`` (the
    whole prompt, no TTL) or an object of optional ``ttl_s`` (seconds, > 0, at most a
    year) and ``tokens`` (a count > 0: only the blocks wholly within that many prompt
    tokens, a system prompt say); None for no pin (absent, false or null). Any other
    value is logged as a warning naming the request and the key, and nothing is pinned
    (a typo in ``ttl_s`` must not pin for ever); the request runs either way. Called by
    ``client.vllm.save_tracking`` once per request, when it is first scheduled."""
    value = params.get(PIN_PARAM) if isinstance(params, dict) else None
    if value is None or value is False:
        return None
    if value is True:
        return PinAsk()
    why = _pin_refusal(value)
    if why is None:
        ttl = value.get("ttl_s")
        return PinAsk(None if ttl is None else float(ttl), value.get("tokens"))
    log.warning(
        "request %s: kv_transfer_params[%r] %s, got %r; not pinned (the request runs)",
        req_id,
        PIN_PARAM,
        why,
        value,
    )
    return None


def _pin_refusal(value: Any) -> str | None:
    """What is wrong with a ``kvstore_pin`` value other than true, false and null."""
    if not isinstance(value, dict):
        return 'must be true, false or {"ttl_s": seconds, "tokens": count}'
    unknown = sorted(str(k) for k in value if k not in _PIN_KEYS)
    if unknown:
        return f"has unknown key(s) {', '.join(unknown)} (known: ttl_s, tokens)"
    ttl, tokens = value.get("ttl_s"), value.get("tokens")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_PIN_TTL_S
    ):
        return f"ttl_s must be seconds in (0, {MAX_PIN_TTL_S:.0f}] or null (no TTL)"
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0
    ):
        return "tokens must be a count of prompt tokens > 0 or null (the whole prompt)"
    return None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Whether a proxy asked this (prefill) request to announce its KV for a decode."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def announcement(
    block_size: int, tokens: list[int], extras: BlockExtras, blocks: int
) -> dict[str, Any]:
    """The params a prefill's ``request_finished`` returns for the decode: its save
    stores ``blocks`` full blocks of ``tokens`` under ``extras``."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvstore_blocks": blocks,
        "kvstore_block_size": block_size,
        "kvstore_prefix": prefix_fingerprint(
            block_size, tokens[: blocks * block_size], extras
        ).hex(),
    }


@dataclass(frozen=True)
class Announced:
    """A decode request's announcement: the first ``blocks`` full blocks of its prompt
    are on their way to the store, or (``usable`` False) params it cannot wait for."""

    blocks: int
    usable: bool = True


UNUSABLE = Announced(0, usable=False)


def announced(
    params: dict[str, Any] | None,
    block_size: int,
    tokens: list[int],
    extras: BlockExtras,
    req_id: str,
) -> Announced | None:
    """What a decode request's params announce: ``Announced`` when they name a prefix of
    this prompt and identity (at most the blocks the prompt has); None when they
    announce nothing (no params, or another connector's); ``UNUSABLE`` when they
    announce a prefix this request cannot wait for (logged: the caller counts it and
    looks it up)."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    if "kvstore_blocks" not in params:
        return None  # another connector's handoff (NIXL's remote_block_ids, say)
    blocks, size, prefix = (
        params.get("kvstore_blocks"),
        params.get("kvstore_block_size"),
        params.get("kvstore_prefix"),
    )
    why = None
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        why = f"kvstore_blocks must be a count of blocks, got {blocks!r}"
    elif not isinstance(prefix, str):
        why = f"kvstore_prefix must be a hex string, got {prefix!r}"
    elif size != block_size:
        why = f"the prefill's block size {size!r} is not this engine's {block_size}"
    elif blocks * block_size > len(tokens):
        why = f"{blocks} blocks announced, the prompt has {len(tokens) // block_size}"
    elif prefix_fingerprint(block_size, tokens[: blocks * block_size], extras).hex() != prefix:
        why = "they name another prompt or identity (LoRA, cache_salt, images, embeddings)"
    if why is not None or not isinstance(blocks, int):
        _LIMIT.warning(
            "announcement",
            "request %s: the prefill's kv_transfer_params cannot be waited for (%s); "
            "the prompt is looked up as any other",
            req_id,
            why,
        )
        return UNUSABLE
    return Announced(blocks)
