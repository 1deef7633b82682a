# Types of the C extension _resp.c (an index command's RESP bytes), for the type checker.
from typing import Any

def pack(args: tuple[Any, ...], /) -> bytes | None: ...
