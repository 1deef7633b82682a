# Types of the C extension _match.c (which index entries answer a lookup, and which are
# live), for the type checker. Buffers: bytes, bytearray or contiguous numpy arrays.
from collections.abc import Sequence
from typing import Any

def pick(
    blob: Any, recs: Any, runs: Any, first: int, need: int, firsts: Any | None, needs: Any | None, /
) -> tuple[bytearray, bytearray, bytearray]: ...
def resolve(
    recs: Any,
    positions: Any,
    units: Any,
    tags: Sequence[int],
    covered: int,
    need: int,
    needs: Any | None,
    last: bool,
    /,
) -> tuple[int, bytearray, bytearray, bytearray]: ...
def present(
    recs: Any,
    positions: Any,
    units: Any,
    tags: Sequence[int],
    covered: int,
    need: int,
    needs: Any | None,
    /,
) -> bytearray: ...
def live(recs: Any, tags: Sequence[int], /) -> bytearray: ...
