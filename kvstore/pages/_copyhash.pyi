# Types of the C extension _copyhash.c (a copy and its xxh3 in one loop), for the type checker.
from collections.abc import Sequence

import numpy as np
from typing_extensions import Buffer

# The C code takes any C-contiguous buffer. numpy arrays are named beside Buffer because
# numpy's stubs give ndarray __buffer__ only from Python 3.12.
_Bytes = Buffer | np.ndarray

def bind(path: str, /) -> bool: ...
def copy_hash(
    pairs: Sequence[tuple[_Bytes | tuple[_Bytes, ...], _Bytes | tuple[_Bytes, ...]]],
    hash_source: bool,
    stream: bool,
    /,
) -> list[int] | None: ...
