"""The bodies of the operator control API (docs/operations.md, "Steering the cache").

Every node serves ``POST /v1/kv/pin``, ``/v1/kv/unpin``, ``/v1/kv/prefetch`` and
``/v1/kv/clear`` on its metrics port, beside the prefix query (``/v1/kv/query``, whose
``residency`` field answers "where"). A request acts on the pages *that node* holds;
the callers (``kvstore.control.caller``) send it to every live node and add up the
answers, so replicas are pinned, cleared or prefetched alike.

A prefix is named one of two ways, as the query API names it:

- the token form: ``model`` and ``token_ids``, with ``lora_name``, ``cache_salt`` and
  ``block_size`` as the query takes them; the node hashes the tokens for every
  namespace registered under the model and tenant;
- the hash form: ``block_hashes`` (the store's, 32 hex digits each, in prefix order)
  of the namespace ``namespace`` (its digest) or of every namespace of ``model``.

Authorised like the query, but as a write: the bearer token must name a read-write
credential of the tenant (a tenant's token acts on its own tenant only; ``*`` on any).
Errors come back as ``{"error": "..."}``: 400 a bad body (naming the field), 401/403
the token, 409 a pin the node's limits refuse (naming the limit), 503 the index."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstore.pages.namespace import TENANT_PATTERN

CONTROL_PATHS = ("/v1/kv/pin", "/v1/kv/unpin", "/v1/kv/prefetch", "/v1/kv/clear")
MAX_PIN_TTL_S = 365 * 24 * 3600.0
MAX_CONTROL_TOKENS = 1 << 22
HEX_DIGEST = r"^[0-9a-f]{32}$"


class Scope(BaseModel):
    """Which pages a control request names: a tenant's, narrowed to a model or one
    namespace, narrowed to a prefix (``token_ids`` or ``block_hashes``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field("default", pattern=TENANT_PATTERN)
    model: str | None = Field(None, min_length=1)
    namespace: str | None = Field(None, pattern=HEX_DIGEST)
    token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_CONTROL_TOKENS)
    block_hashes: list[str] | None = Field(None, min_length=1)
    lora_name: str | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, min_length=1)
    block_size: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> Scope:
        if self.token_ids is not None and self.block_hashes is not None:
            raise ValueError("give token_ids or block_hashes, not both")
        if self.token_ids is not None:
            if self.model is None:
                raise ValueError("token_ids need model (the node hashes them per namespace)")
            if any(not 0 <= t < 2**32 for t in self.token_ids):
                raise ValueError("token ids must lie in [0, 2**32)")
        if self.block_hashes is not None:
            if self.model is None and self.namespace is None:
                raise ValueError("block_hashes need namespace (a digest) or model")
            for h in self.block_hashes:
                if len(h) != 32 or any(c not in "0123456789abcdef" for c in h):
                    raise ValueError("block_hashes are 32 lower-case hex digits each")
        return self

    @property
    def has_prefix(self) -> bool:
        return self.token_ids is not None or self.block_hashes is not None


class PrefixRequest(Scope):
    """``/v1/kv/unpin`` and ``/v1/kv/prefetch``: a prefix is required."""

    @model_validator(mode="after")
    def _prefix_given(self) -> PrefixRequest:
        if not self.has_prefix:
            raise ValueError("give the prefix: token_ids (with model) or block_hashes")
        return self


class PinRequest(PrefixRequest):
    """``/v1/kv/pin``: keep the prefix's pages in memory, for ``ttl_s`` seconds or, when
    None, until unpinned. A new pin of a pinned page replaces its TTL."""

    ttl_s: float | None = Field(None, gt=0, le=MAX_PIN_TTL_S)


class ClearRequest(Scope):
    """``/v1/kv/clear``: every page of the tenant; of one model (or one namespace); or
    of one prefix. Cleared pages leave the index at once (later lookups miss) and the
    node after the clear grace (a reader that looked up before finishes)."""


class NodeAction(BaseModel):
    """One node's answer to pin, unpin, prefetch or clear: the pages it acted on.

    ``pages``/``bytes``: pinned, unpinned, brought into memory, or cleared. ``memory``
    and ``disk``: of those, the pages that had a memory copy, and those only on disk
    (before the action). ``missing``: pages the prefix names that this node does not
    hold (pin, unpin, prefetch). ``blocks``: blocks of the prefix whose every page the
    node acted on."""

    node_id: str
    action: str
    pages: int = 0
    bytes: int = 0
    memory: int = 0
    disk: int = 0
    missing: int = 0
    blocks: int = 0


class BlockResidency(BaseModel):
    """One block of a prefix as the answering node holds it (``/v1/kv/query`` with
    ``residency``): ``tier`` CPU when every page of the block is in memory, else DISK;
    ``pinned`` when every page is pinned, with the seconds the shortest pin has left
    (``pin_ttl_s``; None: until unpinned)."""

    block: int
    tier: str
    pinned: bool = False
    pin_ttl_s: float | None = None
