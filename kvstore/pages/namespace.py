"""Namespaces: everything that makes two KV pages incompatible.

Two pages may only be exchanged when their namespaces are equal; the namespace digest
is mixed into every block hash, so pages of different models, dtypes, geometries,
layouts, tensor-parallel ranks or tenants can never match each other."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from math import prod
from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvstore.errors import InvalidInputError
from kvstore.pages.keys import NamespaceKey
from kvstore.pages.layouts import LAYOUTS

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

# Tenant names become parts of Redis key names that ACL patterns match
# (docs/security.md), so they may not hold pattern or separator characters.
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_TENANT_RE = re.compile(TENANT_PATTERN)
# A tenant name in a pydantic model (namespaces, wire frames, connector options).
Tenant = Annotated[str, Field(pattern=TENANT_PATTERN)]


def check_tenant(tenant: object, what: str = "tenant") -> str:
    """``tenant`` if it is a valid tenant name, else ``InvalidInputError`` naming
    ``what`` (credentials, ACL rules and the index call it with their own context)."""
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise InvalidInputError(f"{what} {tenant!r} must match {TENANT_PATTERN}")
    return tenant


FORMAT_VERSION = 1
NAMESPACE_PERSON = b"kvs-ns-v1"

# Bytes per element of each supported dtype name (torch spelling).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Page layouts (one record each, kvstore.pages.layouts): how one block of KV for all
# layers of a pipeline stage is laid out.


class Namespace(BaseModel):
    """A frozen description of a page format; equal namespaces have equal digests.

    Built by clients (and the vLLM connector) from the engine's configuration. The
    digest is stable across processes, machines and Python runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="model id, e.g. meta-llama/Llama-3.1-8B")
    dtype: str = Field(description="element dtype of the KV cache (torch name)")
    num_layers: int = Field(gt=0, description="layers held by this pipeline stage")
    num_kv_heads: int = Field(gt=0, description="KV heads held by this tensor-parallel rank")
    head_size: int = Field(gt=0)
    block_size: int = Field(gt=0, description="tokens per page")
    layout: str = Field(default="kv_lbhd", description="page layout tag, one of LAYOUTS")
    hidden_size: int = Field(default=0, ge=0, description="hidden-state width; 0: not stored")
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, gt=0)
    pp_rank: int = Field(default=0, ge=0)
    tenant: Tenant = Field(
        default="default",
        description="who owns the pages; data-plane credentials grant rights per tenant, and index keys carry it",
    )
    format_version: int = Field(default=FORMAT_VERSION, ge=1)
    total_kv_heads: int = Field(
        default=0,
        ge=0,
        description=(
            "KV heads of the model (0: num_kv_heads * tp_size); "
            "needed when tp_size exceeds them (replicated heads)"
        ),
    )
    head_groups: int = Field(
        default=0,
        ge=0,
        description=(
            "groups the model's KV heads are stored in, one page each per block; engines of "
            "different TP sizes share pages when they agree on it (0: min(tp_size, KV heads))"
        ),
    )
    total_layers: int = Field(
        default=0,
        ge=0,
        description=(
            "layers of the model (0: num_layers); set for a pipeline stage, whose pages are "
            "then stored as layer groups that engines of any PP split share"
        ),
    )
    first_layer: int = Field(
        default=0, ge=0, description="the model layer this pipeline stage's first layer is"
    )
    layer_groups: int = Field(
        default=0,
        ge=0,
        description=(
            "groups the model's layers are stored in, one unit each per block and head group; "
            "engines of different PP sizes share pages when they agree on it and their stages "
            "hold whole groups (0: one group)"
        ),
    )
    state: str = Field(
        default="",
        max_length=512,
        description=(
            "a state-space layer's state format (its kind, tensor dtypes and shapes, conv "
            "layout): the bytes of a boundary-state page mean this (empty: not such a page)"
        ),
    )
    weights: str = Field(
        default="",
        max_length=256,
        description=(
            "which weights computed the KV: an operator's revision (weights_revision) or a "
            "fingerprint of the checkpoint's files; new weights under the same model name "
            "never read the old pages (empty: not stated)"
        ),
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, value: object) -> str:
        name = str(value).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {value!r}; expected one of {sorted(DTYPE_SIZES)}")
        return name

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, value: str) -> str:
        if value not in LAYOUTS:
            raise ValueError(f"unknown page layout {value!r}; expected one of {list(LAYOUTS)}")
        return value

    @model_validator(mode="after")
    def _rank_in_range(self) -> Namespace:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be below tp_size {self.tp_size}")
        total = self.total_heads
        if self.total_kv_heads:
            if self.tp_size <= total and self.num_kv_heads * self.tp_size != total:
                raise ValueError(
                    f"num_kv_heads {self.num_kv_heads} x tp_size {self.tp_size} "
                    f"must equal total_kv_heads {total}"
                )
            if self.tp_size > total and (self.num_kv_heads != 1 or self.tp_size % total):
                raise ValueError(
                    f"with tp_size {self.tp_size} above total_kv_heads {total}, each rank holds "
                    f"1 replicated head and tp_size must be a multiple of {total}"
                )
        if total % self.groups:
            raise ValueError(f"head_groups {self.groups} must divide the model's {total} KV heads")
        layers, groups = self.model_layers, self.lgroups
        if self.first_layer + self.num_layers > layers:
            raise ValueError(
                f"layers {self.first_layer} to {self.first_layer + self.num_layers - 1} "
                f"lie past the model's {layers}"
            )
        if (
            layers % groups
            or self.first_layer % (layers // groups)
            or self.num_layers % (layers // groups)
        ):
            raise ValueError(
                f"layer_groups {groups} must divide the model's {layers} layers into groups this stage "
                f"(layers {self.first_layer} to {self.first_layer + self.num_layers - 1}) holds whole"
            )
        if self.num_layers > layers // groups and self.groups > 1 and not self.stores_all_heads:
            raise ValueError(
                f"a rank holding part of the heads ({self.groups} head groups, "
                f"tp_size {self.tp_size}) must hold one layer group, "
                f"not {self.num_layers // (layers // groups)}: its units would not be consecutive"
            )
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A validated copy with ``update`` applied. pydantic's own copy would carry the
        cached ``digest`` of this namespace over to the copy (measured: a copy with
        another layout kept the original digest), naming the wrong pages."""
        return type(self).model_validate({**self.model_dump(), **(update or {})})

    def canonical_json(self) -> str:
        """The exact text hashed into the digest: sorted keys, no spaces. Fields added
        after format 1 appear only when set, so older namespaces keep their digests."""
        fields = self.model_dump()
        for late in (
            "total_kv_heads",
            "head_groups",
            "weights",
            "state",
            "total_layers",
            "first_layer",
            "layer_groups",
        ):
            if not fields[late]:
                del fields[late]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @property
    def total_heads(self) -> int:
        """The model's KV heads (every rank's together)."""
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    @property
    def groups(self) -> int:
        """Head groups a block is stored in (kvstore.pages.heads)."""
        return self.head_groups or min(self.tp_size, self.total_heads)

    @property
    def group_heads(self) -> int:
        return self.total_heads // self.groups

    @property
    def stores_all_heads(self) -> bool:
        """Whether this rank holds every KV head of the model."""
        return self.head_range == (0, self.total_heads)

    @property
    def model_layers(self) -> int:
        """The model's layers (every pipeline stage's together)."""
        return self.total_layers or self.num_layers

    @property
    def lgroups(self) -> int:
        """Layer groups a block is stored in (kvstore.pages.heads)."""
        return self.layer_groups or 1

    @property
    def group_layers(self) -> int:
        return self.model_layers // self.lgroups

    @property
    def layer_dim(self) -> int:
        """The index of the layer dimension in ``page_shape``."""
        return LAYOUTS[self.layout].axis("L")

    @property
    def head_range(self) -> tuple[int, int]:
        """The model heads ``[lo, hi)`` this rank holds (vLLM's split: contiguous equal
        slices, or one replicated head each when tp_size exceeds the heads)."""
        total = self.total_heads
        if self.tp_size <= total:
            return self.tp_rank * self.num_kv_heads, (self.tp_rank + 1) * self.num_kv_heads
        head = self.tp_rank * total // self.tp_size
        return head, head + 1

    @property
    def stores_heads(self) -> bool:
        """Whether this rank writes its heads' pages. Every rank does, except where
        ranks hold the same replicated head (``tp_size`` above the model's KV heads;
        MLA's latent, one "head" on every rank): there the first rank of each head
        writes and the others only read, their pages being the same bytes."""
        total = self.total_heads
        return self.tp_size <= total or self.tp_rank % (self.tp_size // total) == 0

    @property
    def keyed(self) -> bool:
        """Whether pages are keyed by an engine's own page keys (``PageLayout.keyed``)."""
        return LAYOUTS[self.layout].keyed

    @property
    def head_dim(self) -> int:
        """The index of the KV-head dimension in ``page_shape``."""
        return LAYOUTS[self.layout].axis("H")

    @cached_property
    def storage(self) -> Namespace:
        """What this rank's pages are stored as, the same for every TP layout of the
        model: the TP=1 namespace of all heads, with the head groups when more than one.
        Its digest names the index namespace and goes into every block hash. With one
        group it equals the TP=1 namespace, so a TP=1 engine's pages are what they were.
        A pipeline stage (``total_layers`` set) is stored as the whole model's layers in
        its layer groups, the same for every PP split (``pp_rank`` 0)."""
        update = {
            "num_kv_heads": self.total_heads,
            "tp_rank": 0,
            "tp_size": 1,
            "total_kv_heads": 0,
            "head_groups": self.groups if self.groups > 1 else 0,
            "num_layers": self.model_layers,
            "total_layers": 0,
            "first_layer": 0,
            "layer_groups": self.lgroups if self.lgroups > 1 else 0,
        }
        if self.total_layers:
            update["pp_rank"] = 0
        return self.model_copy(update=update)

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of one stored unit: a page of one head group and one layer group."""
        return self._shape(self.group_heads, self.group_layers)

    @property
    def unit_nbytes(self) -> int:
        return prod(self.unit_shape) * self.element_size

    @cached_property
    def digest(self) -> bytes:
        """16-byte blake2b digest of ``canonical_json()``; mixed into every block hash."""
        return hashlib.blake2b(
            self.canonical_json().encode(), digest_size=16, person=NAMESPACE_PERSON
        ).digest()

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    @cached_property
    def key(self) -> NamespaceKey:
        """Where this namespace's keys live in the index (built once: every lookup asks)."""
        return NamespaceKey(self.tenant, self.digest_hex)

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page (one block of tokens, every layer) in this layout."""
        return self._shape(self.num_kv_heads, self.num_layers)

    def _shape(self, heads: int, layers: int) -> tuple[int, ...]:
        return LAYOUTS[self.layout].page_shape(
            layers=layers, block_size=self.block_size, heads=heads, head_size=self.head_size
        )

    @property
    def page_nbytes(self) -> int:
        return prod(self.page_shape) * self.element_size

    @property
    def token_kv_nbytes(self) -> int:
        """Bytes of K plus V for one token across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.element_size

    def torch_dtype(self) -> torch.dtype:
        # torch is imported here, not at the top: the CLI starts without it
        import torch

        return getattr(torch, self.dtype)
