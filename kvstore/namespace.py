"""Namespaces: everything that makes two KV pages incompatible.

Two pages may only be exchanged when their namespaces are equal; the namespace digest
is mixed into every block hash, so pages of different models, dtypes, geometries,
layouts, tensor-parallel ranks or tenants can never match each other."""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from math import prod

from kvstore.credentials import TENANT_PATTERN
from kvstore.keys import NamespaceKey
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

# Page layouts: how one block of KV for all layers of a pipeline stage is laid out.
#   kv_lbhd     [2, layers, block_size, kv_heads, head_size]   (insert/select API)
#   vllm_cpu    [layers, kv_heads, block_size, 2 * head_size]  (vLLM CPU attention backend)
#   vllm_flash  [layers, 2, block_size, kv_heads, head_size]   (vLLM FlashAttention backend)
LAYOUTS = ("kv_lbhd", "vllm_cpu", "vllm_flash")


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
    tenant: str = Field(default="default", pattern=TENANT_PATTERN, description="who owns the pages; data-plane credentials grant rights per tenant, and index keys carry it")
    format_version: int = Field(default=FORMAT_VERSION, ge=1)

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
        return self

    def canonical_json(self) -> str:
        """The exact text hashed into the digest: sorted keys, no spaces."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    @cached_property
    def digest(self) -> bytes:
        """16-byte blake2b digest of ``canonical_json()``; mixed into every block hash."""
        return hashlib.blake2b(
            self.canonical_json().encode(), digest_size=16, person=NAMESPACE_PERSON
        ).digest()

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    @property
    def key(self) -> NamespaceKey:
        """Where this namespace's keys live in the index."""
        return NamespaceKey(self.tenant, self.digest_hex)

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page (one block of tokens, every layer) in this layout."""
        L, B, H, D = self.num_layers, self.block_size, self.num_kv_heads, self.head_size
        if self.layout == "kv_lbhd":
            return (2, L, B, H, D)
        if self.layout == "vllm_cpu":
            return (L, H, B, 2 * D)
        return (L, 2, B, H, D)

    @property
    def page_nbytes(self) -> int:
        return prod(self.page_shape) * self.element_size

    @property
    def token_kv_nbytes(self) -> int:
        """Bytes of K plus V for one token across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.element_size

    def torch_dtype(self):  # -> torch.dtype; torch is imported lazily for light CLI start-up
        import torch

        return getattr(torch, self.dtype)
