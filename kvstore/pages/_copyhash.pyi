# Types of the C extension _copyhash.c (a copy and its xxh3 in one loop), for the type checker.
from collections.abc import Sequence

from typing_extensions import Buffer

def bind(path: str, /) -> bool: ...
def copy_hash(
    pairs: Sequence[tuple[Buffer | tuple[Buffer, ...], Buffer | tuple[Buffer, ...]]],
    hash_source: bool,
    stream: bool,
    /,
) -> list[int] | None: ...
