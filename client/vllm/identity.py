"""A vLLM request's identity, as kvstore keys it (``kvstore.pages.identity``).

vLLM's own prefix cache keys each block by its tokens and per-block extra keys
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``): the LoRA
adapter, multimodal items, ``cache_salt`` and prompt embeddings. The scheduler side of
the connector reads the same four facts from the ``Request`` into a
``RequestIdentity`` and resolves it to blocks once per request; lookups and the
workers' saves hash with the result, so a request never reads pages computed under
another adapter, image, salt or embedding.

- The adapter is its name and a fingerprint of its files (``kvstore.pages.weights``),
  computed once per adapter path: vLLM keys name and path, which differ between
  machines holding the same adapter; the files' content is what the KV depends on. An
  adapter whose files cannot be read is keyed by name and path, as vLLM does.
- ``kv_transfer_params["kvstore_weights_revision"]`` adds a per-request weights
  version (an RL loop's policy step) to block 0.
- A request carrying an extra key this module does not know (a later vLLM's) is
  neither looked up nor saved: it is logged once per kind and counted in
  ``vllm:kvstore_unkeyed_requests_total``. vLLM's keys are read for the first and the
  last full block of the prompt."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvstore.pages.identity import NO_EXTRAS, BlockExtras, MultimodalItem, RequestIdentity
from kvstore.pages.weights import fingerprint

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# The kinds of vLLM 0.32's block-hash extra keys (the first item of each key tuple).
KNOWN_EXTRA_KEYS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})
WEIGHTS_PARAM = "kvstore_weights_revision"


@dataclass(frozen=True)
class KeyedPrompt:
    """A request's prompt tokens (placeholder zeros where prompt embeddings stand, as
    in vLLM's own hashing) and its identity resolved to blocks."""

    tokens: list[int]
    extras: BlockExtras


class Unkeyable(Exception):
    """A request whose identity kvstore cannot express; the message says why."""


class IdentityReader:
    """Scheduler side: a ``Request`` to its ``KeyedPrompt``. Remembers adapter
    fingerprints by path, and which unknown kinds it has logged."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._adapters: dict[tuple[str, str], str] = {}
        self._logged: set[str] = set()

    def keyed(self, request: Request) -> KeyedPrompt:
        """The prompt and identity of ``request``; raises ``Unkeyable`` when it carries
        what kvstore cannot key (logged once per reason)."""
        tokens = prompt_tokens(request)
        try:
            unknown = unknown_extra_key(request, self._block_size, len(tokens))
            if unknown is not None:
                raise Unkeyable(
                    f"vLLM keys its blocks by an extra key kvstore does not know ({unknown!r})"
                )
            identity = RequestIdentity(
                adapter=self._adapter(request.lora_request),
                cache_salt=request.cache_salt or None,
                weights_revision=_weights_param(request.kv_transfer_params),
                multimodal=tuple(
                    MultimodalItem(
                        hash=str(f.identifier),
                        offset=f.mm_position.offset,
                        length=f.mm_position.length,
                    )
                    for f in request.mm_features or ()
                ),
                prompt_embeds=request.prompt_embeds,
            )
        except ValidationError as exc:
            raise self._logged_once(f"its identity is invalid: {exc.errors()[0]['msg']}") from None
        except Unkeyable as exc:
            raise self._logged_once(str(exc)) from None
        return KeyedPrompt(
            tokens,
            identity.block_extras(self._block_size, len(tokens))
            if not identity.empty
            else NO_EXTRAS,
        )

    def _logged_once(self, reason: str) -> Unkeyable:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "KVStoreConnector: requests are neither looked up nor saved when %s "
                "(logged once; counted in vllm:kvstore_unkeyed_requests_total)",
                reason,
            )
        return Unkeyable(reason)

    def _adapter(self, lora: Any) -> str | None:
        if not lora:
            return None
        key = (str(lora.lora_name), str(lora.lora_path or ""))
        known = self._adapters.get(key)
        if known is None:
            fp = fingerprint(key[1]) if key[1] else None
            known = f"{key[0]}\x00{fp}" if fp else f"{key[0]}\x00path:{key[1]}"
            self._adapters[key] = known
        return known


def prompt_tokens(request: Request) -> list[int]:
    """The prompt's token ids as vLLM hashes them: zeros where prompt embeddings stand."""
    if request.prompt_token_ids is not None and request.prompt_embeds is None:
        return list(request.prompt_token_ids)
    return list(request.all_token_ids[: request.num_prompt_tokens])


def unknown_extra_key(request: Request, block_size: int, num_tokens: int) -> Any:
    """The first of vLLM's extra keys for ``request``'s first and last full blocks whose
    kind kvstore does not know; None when there is none."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    full = num_tokens // block_size
    for block in sorted({0, full - 1}) if full else ():
        keys, _ = generate_block_hash_extra_keys(
            request, block * block_size, (block + 1) * block_size, 0
        )
        for key in keys or ():
            if not (isinstance(key, tuple) and key and key[0] in KNOWN_EXTRA_KEYS):
                return key[0] if isinstance(key, tuple) and key else key
    return None


def _weights_param(params: dict[str, Any] | None) -> str | None:
    value = params.get(WEIGHTS_PARAM) if isinstance(params, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise Unkeyable(
            f"kv_transfer_params[{WEIGHTS_PARAM!r}] is not a non-empty string ({value!r})"
        )
    return value
