"""``python -m server``: run one storage node (same options as ``kvstore server``)."""

from __future__ import annotations

import asyncio
import logging
import sys

from pydantic import ValidationError

from kvstore.config import ServerSettings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = ServerSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        for err in exc.errors():
            print(f"kvstore server: {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.node import StorageNode  # after logging is configured

    from kvstore.errors import NodeIdInUseError

    try:
        asyncio.run(StorageNode(settings).run())
    except NodeIdInUseError as exc:
        print(f"kvstore server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
