"""A request's identity beyond its tokens: what else its KV depends on.

Two requests with the same tokens in the same namespace can still need different KV:
under another LoRA adapter, behind another image at the same placeholder tokens, with
other prompt embeddings, or in another user's cache (``cache_salt``). vLLM keys its own
prefix cache by these (``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``); kvstore folds the same facts into its portable
chained hash (docs/key-format.md, "Request identity"):

- ``RequestIdentity`` is what a caller says about a request (the API boundary);
- ``BlockExtras`` is that identity resolved to blocks: a 16-byte digest for each block
  whose hash it changes. Only those blocks hash differently, and every later block
  follows through the chain, so a plain request (no identity) keeps today's hashes and
  costs what it cost, and a request with an image at token 500 still shares its blocks
  before it.

Where each fact enters, as in vLLM: the adapter, the salt and a per-request weights
revision enter block 0 (the chain carries them into every block); a multimodal item
enters every block its placeholder tokens overlap, with its offset from the block's
start and its length; prompt embeddings enter every block, as a digest of that block's
rows. Nothing here depends on PYTHONHASHSEED or on vLLM's random ``NONE_HASH``."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstore.errors import InvalidInputError

HASH_BYTES = 16
EXTRA_PERSON = b"kvs-extra-v1"
EMBEDS_PERSON = b"kvs-embeds-v1"
# One tag byte per kind of fact, in the order they are written within a block.
_ADAPTER, _SALT, _WEIGHTS, _MULTIMODAL, _EMBEDS = b"L", b"S", b"W", b"M", b"E"


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


class MultimodalItem(BaseModel):
    """One multimodal input (an image, an audio clip) and the placeholder tokens it
    occupies in the prompt: ``[offset, offset + length)``. ``hash`` identifies its
    content (vLLM's ``MultiModalFeatureSpec.identifier``, or any content hash the
    caller computes the same way for the same input)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hash: str = Field(min_length=1, description="content hash of the item")
    offset: int = Field(ge=0, description="first placeholder token")
    length: int = Field(gt=0, description="placeholder tokens")


class RequestIdentity(BaseModel):
    """What a request's KV depends on besides its token ids and the namespace: pass it
    (or its ``block_extras``) to ``lookup``, ``find``, ``put_pages``, ``get_pages``,
    ``insert`` and ``select``. Two requests share a block only when they agree on every
    fact that reaches that block. Empty (the default), it changes nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    adapter: str | None = Field(
        None,
        min_length=1,
        description="LoRA adapter identity (the connector: name and a fingerprint of its files)",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="vLLM's cache_salt: requests of other salts (and unsalted ones) share nothing",
    )
    weights_revision: str | None = Field(
        None,
        min_length=1,
        description="weights version of this request, beside the namespace's (an RL loop's policy step)",
    )
    multimodal: tuple[MultimodalItem, ...] = Field(
        (), description="multimodal items, in prompt order"
    )
    prompt_embeds: Any = Field(
        None,
        description="prompt embeddings, [prompt tokens, hidden] (a torch tensor or numpy array)",
    )

    @model_validator(mode="after")
    def _embeds_are_rows(self) -> RequestIdentity:
        if self.prompt_embeds is not None and len(getattr(self.prompt_embeds, "shape", ())) != 2:
            raise ValueError(
                f"prompt_embeds must be a 2-D tensor [tokens, hidden], got {type(self.prompt_embeds).__name__} "
                f"of shape {tuple(getattr(self.prompt_embeds, 'shape', ()))}"
            )
        return self

    @property
    def empty(self) -> bool:
        return not (
            self.adapter
            or self.cache_salt
            or self.weights_revision
            or self.multimodal
            or self.prompt_embeds is not None
        )

    def block_extras(self, block_size: int, num_tokens: int) -> BlockExtras:
        """This identity resolved to the blocks of a ``num_tokens``-token sequence in
        ``block_size``-token blocks (the trailing partial block included: insert/select
        key it). Called by the clients once per call, and by the vLLM connector's
        scheduler once per request; the digests go to workers instead of the inputs."""
        if block_size <= 0 or num_tokens < 0:
            raise InvalidInputError(
                f"block_extras needs block_size > 0 and num_tokens >= 0, got {block_size}, {num_tokens}"
            )
        if self.empty or num_tokens == 0:
            return NO_EXTRAS
        blocks = -(-num_tokens // block_size)
        facts: dict[int, list[bytes]] = {}
        first = b"".join(
            tag + _text(value)
            for tag, value in (
                (_ADAPTER, self.adapter),
                (_SALT, self.cache_salt),
                (_WEIGHTS, self.weights_revision),
            )
            if value
        )
        if first:
            facts[0] = [first]
        for item in self.multimodal:
            if item.offset >= num_tokens:
                continue
            end = min(item.offset + item.length, num_tokens)
            for block in range(item.offset // block_size, -(-end // block_size)):
                # negative when it began in an earlier block
                relative = item.offset - block * block_size
                facts.setdefault(block, []).append(
                    _MULTIMODAL + _text(item.hash) + struct.pack("<qq", relative, item.length)
                )
        if self.prompt_embeds is not None:
            rows = _embeds_rows(self.prompt_embeds)
            if rows.shape[0] < num_tokens:
                raise InvalidInputError(
                    f"prompt_embeds has {rows.shape[0]} rows for {num_tokens} tokens"
                )
            for block in range(blocks):
                facts.setdefault(block, []).append(
                    _EMBEDS + embeds_digest(rows[block * block_size : (block + 1) * block_size])
                )
        digests = {
            b: hashlib.blake2b(
                b"".join(parts), digest_size=HASH_BYTES, person=EXTRA_PERSON
            ).digest()
            for b, parts in facts.items()
        }
        return BlockExtras(tuple(sorted(digests.items())))


def _embeds_rows(embeds: Any) -> Any:
    """``embeds`` as a numpy array of its raw elements, on the host."""
    import numpy as np

    # a torch tensor; bfloat16 has no numpy dtype, so its bits go as int16
    if hasattr(embeds, "detach"):
        import torch

        t = embeds.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return _Rows(t.view(torch.int16).numpy(), "bfloat16")
        return _Rows(t.numpy(), str(t.dtype).removeprefix("torch."))
    arr = np.ascontiguousarray(embeds)
    return _Rows(arr, str(arr.dtype))


@dataclass(frozen=True)
class _Rows:
    """Embedding rows and the dtype name that goes into their digest."""

    array: Any
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def __getitem__(self, rows: slice) -> _Rows:
        return _Rows(self.array[rows], self.dtype)


def embeds_digest(rows: _Rows) -> bytes:
    """blake2b-128 (person "kvs-embeds-v1") of one block's embedding rows: dtype name,
    row width, then the rows' bytes in C order. A cryptographic hash, as vLLM's sha256:
    embeddings come from users, who must not be able to make another block's key."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=EMBEDS_PERSON)
    h.update(_text(rows.dtype) + struct.pack("<I", rows.shape[1]))
    h.update(memoryview(rows.array).cast("B"))
    return h.digest()


@dataclass(frozen=True)
class BlockExtras:
    """A request identity resolved to blocks: ``(block index, 16-byte digest)`` pairs,
    sorted, for the blocks whose hash it changes; every other block hashes as a plain
    one. Picklable and small: the vLLM scheduler hands it to the workers' saves."""

    digests: tuple[tuple[int, bytes], ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.digests)

    def upto(self, blocks: int) -> tuple[tuple[int, bytes], ...]:
        """The digests of blocks below ``blocks``."""
        return tuple((b, d) for b, d in self.digests if b < blocks)

    def at(self, block: int) -> bytes | None:
        for b, d in self.digests:
            if b == block:
                return d
        return None


NO_EXTRAS = BlockExtras()


def resolve(
    identity: RequestIdentity | BlockExtras | None, block_size: int, num_tokens: int
) -> BlockExtras:
    """What the clients' calls accept as ``identity``, as ``BlockExtras``."""
    if identity is None:
        return NO_EXTRAS
    if isinstance(identity, BlockExtras):
        return identity
    if isinstance(identity, RequestIdentity):
        return identity.block_extras(block_size, num_tokens)
    raise InvalidInputError(
        f"identity must be a RequestIdentity or BlockExtras, got {type(identity).__name__}"
    )
