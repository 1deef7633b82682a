"""Page checksums: 64-bit xxh3 over the page bytes (about 10 GB/s, releases the GIL).

Computed by the client before a put, verified by the server before it commits a page
and by the client after every receive."""

import xxhash


def page_checksum(buffer) -> int:
    """xxh3-64 of any object exposing the buffer protocol (numpy arrays, memoryviews)."""
    return xxhash.xxh3_64_intdigest(buffer)
