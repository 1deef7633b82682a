# Types of the C extension _chainhash.c (the chained block hash), for the type checker.
from collections.abc import Sequence

from typing_extensions import Buffer

def uint32_le(items: list[int] | tuple[int, ...], /) -> bytes: ...
def join_hashes(items: Sequence[object], /) -> bytes | int: ...
def split_hashes(joined: bytes, /) -> list[bytes]: ...
def chain(
    prefix: bytes,
    data: Buffer | list[int] | tuple[int, ...],
    step: int,
    person: bytes,
    start: bytes,
    /,
) -> bytes: ...
def each(prefix: bytes, keys: list[str] | tuple[str, ...], person: bytes, /) -> bytes: ...
