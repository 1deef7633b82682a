"""``python -m server``: run one storage node (same options as ``kvstore server``)."""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
from typing import Any

from pydantic import ValidationError
from pydantic_settings import CliSettingsSource

from kvstore.errors import PortInUseError
from kvstore.settings.config import ServerSettings
from kvstore.tools.cli_errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, settings_error

# What each option takes, for --help: pydantic-settings would print the Python types
# (int for a size that accepts "4GiB", SecretStr, {int,null}).
_METAVARS = {
    "capacity": "SIZE",
    "slab_size": "SIZE",
    "hugepage_size": "SIZE",
    "redis_password": "PASSWORD",
    "auth_token": "TOKEN",
    "auth_token_file": "FILE",
    "credentials_file": "FILE",
    "redis_password_file": "FILE",
    "redis_url": "URL",
    "host": "ADDRESS",
    "metrics_host": "ADDRESS",
    "port": "PORT",
    "metrics_port": "PORT",
    "node_id": "NAME",
    "shm_dir": "DIR",
    "ucx_net_devices": "DEVICES",
    "ucx_tls": "TRANSPORTS",
    "oom_score_adj": "SCORE",
    "high_watermark": "FRACTION",
    "low_watermark": "FRACTION",
    "heartbeat_interval": "SECONDS",
    "node_ttl": "SECONDS",
    "transfer_timeout": "SECONDS",
    "min_put_rate": "SIZE",
    "tenant_quota": "FRACTION",
    "pin_max_share": "FRACTION",
    "clear_grace": "SECONDS",
    "max_request_pages": "PAGES",
    "kv_events_endpoint": "ZMQ_ADDRESS",
    "kv_events_replay_endpoint": "ZMQ_ADDRESS",
    "kv_events_store_id": "NAME",
    "kv_events_queue": "EVENTS",
    "kv_events_routers_file": "FILE",
    "kv_events_key_file": "FILE",
    "kv_events_token_ids": "TENANTS",
    "max_request_bytes": "SIZE",
    "shutdown_grace": "SECONDS",
    "max_connections": "CONNECTIONS",
    "frame_timeout": "SECONDS",
    "disk_path": "DIR",
    "disk_capacity": "SIZE",
    "disk_admission": "READS",
    "disk_queue_depth": "DEPTH",
}


def _add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
    """``add_argument`` for pydantic-settings' CLI parser, with readable metavars."""
    field = str(kwargs.get("dest", "")).replace("-", "_")
    if field in _METAVARS:
        kwargs["metavar"] = _METAVARS[field]
    if isinstance(kwargs.get("help"), str):
        kwargs["help"] = kwargs["help"].replace(
            "(default factory: _default_host)", "(default: this host's IP address)"
        )
        kwargs["help"] = kwargs["help"].replace(
            "(default factory: gethostname)", "(default: the host name)"
        )
        kwargs["help"] = (
            kwargs["help"]
            .replace("(default: )", "(default: none)")
            .replace("(default: null)", "(default: none)")
        )
        kwargs["help"] = kwargs["help"].replace(
            "(default factory: gettempdir)", "(default: the temporary directory)"
        )
    return parser.add_argument(*names, **kwargs)


def parse_settings(argv: list[str]) -> ServerSettings:
    """``ServerSettings`` from the command line and KVSTORE_* variables (flags win)."""
    source: CliSettingsSource[ServerSettings] = CliSettingsSource(
        ServerSettings, add_argument_method=_add_argument
    )
    return ServerSettings(_cli_settings_source=source(args=argv))


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        print(f"kvstore server: {settings_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvstore.errors import NodeIdInUseError
    from server.node import StorageNode  # after logging is configured
    from server.oom import set_oom_score_adj

    if settings.oom_score_adj is not None:
        # before the page memory is faulted in: the kernel weighs the node from then on
        set_oom_score_adj(settings.oom_score_adj)

    try:
        asyncio.run(StorageNode(settings).run())
    except NodeIdInUseError as exc:
        print(f"kvstore server: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(
            f"kvstore server: the metrics port {settings.metrics_port} is in use; "
            "pick another with --metrics-port (0: any free port)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except PortInUseError:
        print(
            f"kvstore server: the UCX port {settings.port} is in use; pick another with --port (0: any free port)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
