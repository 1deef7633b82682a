"""Client options: what ``KVCacheClient`` keywords, ``KVSTORE_<NAME>`` environment
variables and the vLLM connector's ``kv_connector_extra_config`` validate through.
The index access they share with the storage node's settings is
``kvstore.settings.config.IndexAccess``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.errors import InvalidInputError
from kvstore.index.page_index import DEFAULT_LEASE_MS
from kvstore.pages.namespace import Namespace
from kvstore.settings.config import ByteSize, IndexAccess, first_error


class ClientOptions(IndexAccess):
    """Every client option, in one place: ``AsyncKVCacheClient``/``KVCacheClient``
    keywords, ``KVSTORE_<NAME>`` environment variables (``ClientSettings``) and the vLLM
    connector's ``kv_connector_extra_config`` all validate through this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(1, ge=1, le=16, description="storage nodes each page is written to")
    timeout: float = Field(
        5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds a call may take before missing pages count as absent",
    )
    transfer_mode: Literal["auto", "direct", "staged"] = Field(
        "auto", description="receive straight into the destination, or through pinned host memory"
    )
    node_refresh: float = Field(
        1.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description=(
            "seconds between background reads of the node registry while the client is in use "
            "(none while it is idle; a call after an idle spell reads it first, a lookup in "
            "its own round trip)"
        ),
    )
    lease_ms: int = Field(
        DEFAULT_LEASE_MS,
        ge=0,
        le=600_000,
        description="read lease a lookup takes on the pages it returns",
    )
    same_host: bool = Field(
        True,
        description="reach nodes on this host through shared memory (kvstore.wire.shm) instead of UCX",
    )
    weights_revision: str = Field(
        "",
        max_length=256,
        description=(
            "which weights the caller's KV comes from (a checkpoint revision, an RL policy "
            "step): set into the namespace, so pages of other weights never match; the vLLM "
            "connector's default is a fingerprint of the checkpoint (docs/key-format.md)"
        ),
    )
    host_buffer_bytes: ByteSize = Field(
        "512MiB",
        validate_default=True,
        description=(
            "host memory faulted in at the first client's start and reused by select's "
            "results and UCX packing and scratch (one pool per process; the largest value "
            "asked for wins; the vLLM connector's staging_bytes adds to it); it grows on "
            "demand to twice this and keeps what it grew; past that, and with 0, fresh memory "
            "per call"
        ),
    )


def client_options(base: ClientOptions | None = None, **overrides: Any) -> ClientOptions:
    """``base`` (or the defaults) with ``overrides`` applied and validated; a bad value
    raises ``InvalidInputError`` naming the option."""
    values = {name: getattr(base, name) for name in ClientOptions.model_fields} if base else {}
    values.update(overrides)
    try:
        return ClientOptions.model_validate(values)
    except ValidationError as exc:
        name, shown, message = first_error(exc)
        raise InvalidInputError(
            f"invalid client option {name}={shown}: {message}"
            if name
            else f"invalid client options: {message}"
        ) from None


class ClientSettings(ClientOptions, BaseSettings):
    """Client options from KVSTORE_* environment variables (``KVCacheClient.from_env``)."""

    model_config = SettingsConfigDict(env_prefix="KVSTORE_", extra="ignore", frozen=True)


def client_options_from_env() -> ClientOptions:
    """``ClientSettings`` read from the environment; a bad value raises
    ``InvalidInputError`` naming the variable."""
    try:
        return ClientSettings()
    except ValidationError as exc:
        name, shown, message = first_error(exc)
        raise InvalidInputError(
            f"invalid KVSTORE_{name.upper()}={shown} (client option {name}): {message}"
            if name
            else f"invalid KVSTORE_* client options: {message}"
        ) from None


def split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A client constructor's keywords split into client options and namespace fields."""
    options = {k: v for k, v in kwargs.items() if k in ClientOptions.model_fields}
    return options, {k: v for k, v in kwargs.items() if k not in options}


def client_namespace(
    namespace: Namespace | None, fields: dict[str, Any], weights_revision: str
) -> Namespace:
    """A client's namespace (its constructor calls this): given, or built from the
    constructor's namespace fields, with the options' ``weights_revision`` set into it."""
    if namespace is None:
        namespace = Namespace(**fields)
    elif fields:
        raise InvalidInputError(
            f"unknown client options {sorted(fields)} (pass either a Namespace or namespace fields)"
        )
    if weights_revision and weights_revision != namespace.weights:
        if namespace.weights:
            raise InvalidInputError(
                f"weights_revision {weights_revision!r} contradicts the namespace's weights {namespace.weights!r}"
            )
        namespace = namespace.model_copy(update={"weights": weights_revision})
    return namespace
