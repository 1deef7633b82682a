"""How a request fails on the data plane, and what the connection does then."""

from __future__ import annotations

from kvstore.wire import protocol as P


class Broken(Exception):
    """The connection can no longer be trusted to be in step; close it."""


class Refused(Exception):
    """The request cannot be served; answered with an ERROR frame, connection kept."""

    def __init__(self, code: P.RefusalCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Unauthorized(Exception):
    """The request's token matches no credential of a node that requires one: answered
    ``unauthorized``, then the connection is closed."""
