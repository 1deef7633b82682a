"""Exit codes and one-line messages of the ``kvstore`` commands (docs/operations.md,
"Exit codes and node ids").

``kvstore.tools.cli`` and ``python -m server`` turn every error a user can cause into one
line on stderr and one of these codes, never a traceback."""

from __future__ import annotations

from pydantic import ValidationError

from kvstore.errors import first_problem

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and failed: a node id or a port in use, nodes that exited
EXIT_USAGE = 2  # a bad option or value: nothing was started
EXIT_INDEX = 3  # the Redis/Valkey index could not be reached


def settings_error(exc: ValidationError) -> str:
    """The first problem of a settings validation, as ``--option: what is wrong``."""
    where, _, message = first_problem(exc)
    return f"--{where.replace('_', '-')}: {message}" if where else message
