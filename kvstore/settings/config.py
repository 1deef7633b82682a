"""Settings of storage nodes and clients: command-line options and KVSTORE_* environment
variables through pydantic-settings (one mechanism for both)."""

from __future__ import annotations

import socket
import tempfile
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.errors import first_problem
from kvstore.index.routing import check_url, redact_url
from kvstore.security.credentials import CredentialFile
from kvstore.settings.events import EventSettings, check_event_settings
from kvstore.settings.sizes import parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size)]
# A log level, case-insensitive ("info" or "INFO").
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]
# An index URL (kvstore.index.urls.check_url names the forms).
IndexURL = Annotated[str, AfterValidator(check_url)]
ProgressMode = Literal["loop", "blocking", "polling", "thread", "thread-polling"]


def _default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# Options whose values are secrets; redis_url may carry one (user-info or ?password=).
SECRET_OPTIONS = frozenset({"redis_password", "auth_token"})
# Most pages one put or get may name, unless --max-request-pages says otherwise: a
# 256k-token prompt in 16-token blocks. The node's RequestLimits default to it too
# (server/dataplane/plane.py); the wire format allows up to 65,536.
DEFAULT_MAX_REQUEST_PAGES = 16_384


def shown_value(name: str, value: Any) -> str:
    """How errors, logs and reprs show option ``name``'s ``value``: secrets hidden,
    index URLs with their password hidden, anything else as ``repr``. A value of
    the wrong type is shown by its type only, since it could be a secret put in the
    wrong place."""
    if isinstance(value, SecretStr):
        return repr(value)
    if name in SECRET_OPTIONS:
        return "'***'" if isinstance(value, str) else f"<{type(value).__name__}, hidden>"
    if name == "redis_url":
        return (
            repr(redact_url(value))
            if isinstance(value, str)
            else f"<{type(value).__name__}, hidden>"
        )
    return repr(value)


def first_error(exc: ValidationError) -> tuple[str, str, str]:
    """Pydantic's first error as (option name, its input as it may be shown, message).
    An error of the whole model (a before-validator's) has no name and shows no input."""
    name, given, message = first_problem(exc)
    return name, shown_value(name, given) if name else "", message


class _RedactedRepr:
    """``repr`` hides the password of the index URL (``SecretStr`` fields hide themselves)."""

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():  # type: ignore[misc]
            yield (name, _Shown(shown_value(name, value)) if name == "redis_url" else value)


class _Shown(str):
    def __repr__(self) -> str:
        return str(self)


def _load_secret_files(data: Any) -> Any:
    """Fill ``auth_token``/``redis_password`` from ``auth_token_file``/``redis_password_file``
    (trailing newline dropped). A secret given both ways must agree, so a stale
    variable cannot silently win over the file."""
    if not isinstance(data, dict):
        return data
    for secret in ("auth_token", "redis_password"):
        path = data.get(f"{secret}_file")
        if not path:
            continue
        try:
            with open(path) as f:
                value = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read {secret}_file {path}: {exc.strerror}") from None
        given = data.get(secret)
        given = given.get_secret_value() if isinstance(given, SecretStr) else given
        if given and given != value:
            raise ValueError(f"{secret} and {secret}_file hold different values: give one of them")
        data = {**data, secret: value}
    return data


class IndexAccess(_RedactedRepr, BaseModel):
    """What nodes and clients both need to reach the index and the data plane: the
    index URL and password, the data-plane token, each secret also from a file, and
    UCX's progress mode. ``ServerSettings`` and ``ClientOptions`` build on it, so each
    is declared once."""

    redis_url: IndexURL = Field(
        "redis://127.0.0.1:6379/0",
        description=(
            "index URL: redis://, rediss:// (TLS), unix://, or "
            "redis+cluster://host:port,host:port (a Redis/Valkey Cluster; rediss+cluster:// "
            "for TLS)"
        ),
    )
    redis_password: SecretStr = Field(
        SecretStr(""), description="index password (overrides one in the URL)"
    )
    redis_password_file: str | None = Field(
        None, description="file holding the index password (keeps it out of the process arguments)"
    )
    auth_token: SecretStr = Field(
        SecretStr(""),
        description=(
            "data-plane token; a node's may read and write every tenant (operators, kvstore "
            "up), tenants get their own in --credentials-file"
        ),
    )
    auth_token_file: str | None = Field(
        None,
        description="file holding the data-plane token (keeps it out of the process arguments)",
    )
    ucx_progress_mode: ProgressMode = Field(
        "loop", description="ucxx progress mode (figures for each in kvstore/wire/transport.py)"
    )

    @model_validator(mode="before")
    @classmethod
    def _secret_files(cls, data: Any) -> Any:
        return _load_secret_files(data)


class ServerSettings(IndexAccess, EventSettings, BaseSettings):
    """Options of ``kvstore server``; each also reads KVSTORE_<NAME> from the environment."""

    model_config = SettingsConfigDict(
        env_prefix="KVSTORE_",
        cli_kebab_case=True,
        cli_prog_name="kvstore server",
        cli_implicit_flags=True,
        extra="ignore",
    )

    capacity: ByteSize = Field(
        "1GiB", validate_default=True, description="bytes of page memory, e.g. 4GiB"
    )
    host: str = Field(
        default_factory=_default_host, description="address clients use to reach this node"
    )
    port: int = Field(0, ge=0, le=65535, description="UCX listener port (0: any free port)")
    node_id: str = Field(
        default_factory=socket.gethostname, min_length=1, description="unique node name"
    )
    metrics_port: int | None = Field(
        9400, ge=0, le=65535, description="HTTP port for /metrics, /healthz, /readyz (0: any)"
    )
    metrics_host: str = Field(
        "127.0.0.1", description="address the metrics server binds (0.0.0.0: every interface)"
    )
    high_watermark: float = Field(
        0.9, gt=0, le=1, description="evict when usage passes this fraction"
    )
    low_watermark: float = Field(0.8, gt=0, lt=1, description="evict down to this fraction")
    slab_size: ByteSize = Field(
        "64MiB",
        validate_default=True,
        description="allocator slab size; also the largest page accepted",
    )
    hugepages: bool = Field(
        True, description="back the pool with huge pages when the kernel offers them"
    )
    hugepage_size: ByteSize = Field(
        "2MiB",
        validate_default=True,
        description="huge page size the pool asks for: 2MiB or 1GiB (the slab size must be a multiple)",
    )
    heartbeat_interval: float = Field(1.0, gt=0, description="seconds between heartbeats")
    node_ttl: float = Field(
        5.0, gt=0, description="seconds without heartbeat before the node counts as dead"
    )
    transfer_timeout: float = Field(
        30.0, gt=0, description="seconds one request may take on the data plane"
    )
    min_put_rate: ByteSize = Field(
        "64MiB",
        validate_default=True,
        description=(
            "slowest put accepted, in bytes per second: a put's payload must arrive within 2 "
            "s plus its size at this rate (and the transfer timeout) or its slots are "
            "released; 0: the transfer timeout alone"
        ),
    )
    tenant_quota: float = Field(
        1.0,
        gt=0,
        le=1,
        description=(
            "largest share of this node's page memory one tenant may hold; a tenant past it "
            "evicts its own least-recently-used pages, never another tenant's"
        ),
    )
    pin_max_share: float = Field(
        0.5, ge=0, le=1, description="largest share of page memory pinned pages may hold"
    )
    clear_grace: float = Field(
        5.0,
        ge=0,
        description="seconds a cleared page is still read by gets that found it (>= clients' lease_ms)",
    )
    max_request_pages: int = Field(
        DEFAULT_MAX_REQUEST_PAGES,
        ge=1,
        le=65_536,
        description=(
            "most pages one put or get may name (a 256k-token prompt in 16-token blocks); a "
            "longer request is refused whole"
        ),
    )
    max_request_bytes: ByteSize = Field(
        "0",
        validate_default=True,
        description=(
            "most page bytes one put may reserve (one request at a time per connection, so "
            "also the bytes in flight per connection); pages past it are refused. 0: no limit "
            "but the pool (set it, and --tenant-quota, when tenants share nodes)"
        ),
    )
    max_connections: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description=(
            "client connections (UCX and same-host together) admitted at once; more are "
            "closed as they arrive. 0: a quarter of the descriptors left after the pool's "
            "memfds and a reserve of 512 (the node raises its soft descriptor limit to the "
            "hard one at start)"
        ),
    )
    frame_timeout: float = Field(
        5.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description=(
            "seconds a new connection may take to send its first request, and a control frame "
            "to arrive whole once its first bytes did; past it the connection is closed"
        ),
    )
    shutdown_grace: float = Field(
        10.0, ge=0, description="seconds to finish in-flight transfers on SIGTERM"
    )
    credentials_file: str | None = Field(
        None,
        description=(
            "file of data-plane credentials, one per line: name, sha256 of the token, read or "
            "readwrite, tenants (see kvstore credential); re-read when it changes"
        ),
    )
    anonymous: bool = Field(
        False,
        description=(
            "serve requests without a credential, every tenant to everyone (development "
            "only); needed when neither a token nor a credentials file is given"
        ),
    )
    ucx_net_devices: str | None = Field(
        None, description="sets UCX_NET_DEVICES (e.g. lo, eth0, mlx5_0:1)"
    )
    ucx_tls: str | None = Field(None, description="sets UCX_TLS (e.g. rc,cuda_copy or tcp)")
    disk_path: str | None = Field(
        None,
        description=(
            "directory of this node's disk tier (local NVMe): pages leaving memory go there "
            "and survive a restart; none: memory only (docs/storage-tiers.md)"
        ),
    )
    disk_capacity: ByteSize = Field(
        "0",
        validate_default=True,
        description=(
            "bytes the disk tier's files may take, e.g. 500GiB (needed with --disk-path; its "
            "files never exceed it)"
        ),
    )
    disk_policy: Literal["write-back", "write-through"] = Field(
        "write-back",
        description=(
            "write-back: a page is written to disk before memory evicts it; write-through: "
            "every stored page is written at once"
        ),
    )
    disk_admission: int = Field(
        0,
        ge=0,
        le=1000,
        description=(
            "gets a page needs before write-back writes it to disk (saves SSD writes, loses "
            "the pages nobody read yet; docs/storage-tiers.md)"
        ),
    )
    disk_queue_depth: int = Field(
        4,
        ge=1,
        le=64,
        description=(
            "the disk tier's I/O depth: reads in flight at once; the same number of pages "
            "queued for writing, written half as many at a time"
        ),
    )
    shm_dir: str = Field(
        default_factory=tempfile.gettempdir,
        description="directory of the Unix socket same-host clients use (shared memory path); empty disables it",
    )
    oom_score_adj: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description=(
            "the node's /proc/self/oom_score_adj: below 0 the kernel's OOM killer picks other "
            "processes of the host or pod first (lowering it needs root or CAP_SYS_RESOURCE; "
            "refused: a warning, the node runs on); none: left as inherited"
        ),
    )
    log_level: LogLevel = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark {self.low_watermark} must be below high_watermark {self.high_watermark}"
            )
        if self.capacity < self.slab_size:
            raise ValueError(
                f"capacity {self.capacity} bytes must be at least one slab ({self.slab_size} bytes)"
            )
        if self.heartbeat_interval * 2 > self.node_ttl:
            raise ValueError("node_ttl must be at least twice heartbeat_interval")
        if not (self.auth_token.get_secret_value() or self.credentials_file or self.anonymous):
            raise ValueError(
                "no data-plane credential: give --auth-token-file or --credentials-file (or "
                "--anonymous for a development node that serves anyone)"
            )
        if self.credentials_file:
            CredentialFile(
                self.credentials_file
            )  # a file that does not load is an error now, not at the first request
        check_event_settings(
            self, checks_tokens=bool(self.auth_token.get_secret_value() or self.credentials_file)
        )
        if self.max_request_bytes and self.max_request_bytes < self.slab_size:
            raise ValueError(
                f"max_request_bytes {self.max_request_bytes} must be at least one slab ({self.slab_size} bytes), or 0"
            )
        if self.disk_path and self.disk_capacity < self.slab_size + (1 << 20):
            raise ValueError(
                f"disk_capacity {self.disk_capacity} bytes must hold at least one slab "
                f"({self.slab_size} bytes) and 1 MiB of metadata when disk_path is given"
            )
        if self.disk_capacity and not self.disk_path:
            raise ValueError(
                "disk_capacity is given without disk_path: say where the disk tier lives"
            )
        if self.hugepage_size not in (2 << 20, 1 << 30):
            raise ValueError(f"hugepage_size must be 2MiB or 1GiB, got {self.hugepage_size} bytes")
        if self.hugepages and self.hugepage_size == 1 << 30 and self.slab_size % self.hugepage_size:
            raise ValueError(
                f"slab_size {self.slab_size} bytes must be a multiple of the 1GiB hugepage size"
            )
        return self
