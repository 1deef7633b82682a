"""Human-readable byte sizes for command-line options and settings ("4GiB", "512M")."""

import re

from kvstore.errors import InvalidInputError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Return the number of bytes in ``value`` ("4GiB", "64Mi", "1000000" or an int).

    Called by the settings validators; raises ``InvalidInputError`` naming the bad text."""
    if isinstance(value, int):
        if value < 0:
            raise InvalidInputError(f"size must not be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidInputError(
            f"cannot read size {value!r}: use a number with an optional unit such as 512MiB or 4GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Render a byte count for people ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
