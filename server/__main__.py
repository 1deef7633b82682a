"""``python -m server``: run one storage node (same options as ``kvstore server``)."""

from __future__ import annotations

import asyncio
import errno
import logging
import sys

from pydantic import ValidationError

from kvstore.cli_errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, settings_error
from kvstore.config import ServerSettings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = ServerSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        print(f"kvstore server: {settings_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.node import StorageNode  # after logging is configured

    from kvstore.errors import NodeIdInUseError

    try:
        asyncio.run(StorageNode(settings).run())
    except NodeIdInUseError as exc:
        print(f"kvstore server: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"kvstore server: the metrics port {settings.metrics_port} is in use; pick another with --metrics-port (0: any free port)", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # ucxx raises its own classes; match the busy one by name
        if type(exc).__name__ != "UCXXBusyError":
            raise
        print(f"kvstore server: the UCX port {settings.port} is in use; pick another with --port (0: any free port)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
