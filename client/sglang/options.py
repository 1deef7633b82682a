"""The backend's options: what an SGLang operator puts in
``--hicache-storage-backend-extra-config`` beside SGLang's own keys, read once when
SGLang builds the backend (``KVStoreHiCache``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import Tenant
from kvstore.settings.client import ClientOptions, client_options, client_options_from_env
from kvstore.settings.config import first_error

# Keys SGLang reads from the same JSON for itself (its dynamic loader, the v1 switch, its
# prefetch knobs, which 0.5.23 takes out before the backend sees the dict, and a tag its
# other backends read): never an option of ours.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "extra_backend_tag",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


class HiCacheOptions(BaseModel):
    """The backend's own keys in the extra config (every other key, but SGLang's, is a
    client option: ``redis_url``, ``auth_token_file``, ``timeout``...; unset ones come
    from ``KVSTORE_*`` variables, as for the vLLM connector)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: Tenant = Field(
        "default",
        description="namespace tenant: whose pages these are (credentials and index ACLs are per tenant)",
    )
    model: str | None = Field(
        None,
        description="model name shared by servers that load the same weights from different paths "
        "(default: SGLang's model name)",
    )
    kv_cache_dtype: Literal["float8_e4m3fn", "float8_e5m2"] | None = Field(
        None,
        description="the fp8 format of an fp8 KV cache (SGLang's --kv-cache-dtype), whose "
        "host pool holds bytes (uint8) of either: required there, so the two never mix",
    )


def hicache_options(extra_config: dict[str, Any] | None) -> tuple[HiCacheOptions, ClientOptions]:
    """The backend's options and the client's from SGLang's extra config; raises
    ``InvalidInputError`` naming the key that is wrong (a typo never passes silently)."""
    ours: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in (extra_config or {}).items():
        if key in SGLANG_KEYS:
            continue
        if key in HiCacheOptions.model_fields:
            ours[key] = value
        elif key in ClientOptions.model_fields:
            client[key] = value
        else:
            known = sorted({*HiCacheOptions.model_fields, *ClientOptions.model_fields})
            raise InvalidInputError(
                f"unknown key {key!r} in the kvstore HiCache extra config; its keys are {known}"
            )
    try:
        options = HiCacheOptions(**ours)
    except ValidationError as exc:
        name, shown, message = first_error(exc)
        raise InvalidInputError(
            f"invalid kvstore HiCache option {name}={shown}: {message}"
        ) from None
    return options, client_options(client_options_from_env(), **client)
