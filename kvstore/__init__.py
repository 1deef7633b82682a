"""Core library of the KV-cache store: namespaces and block hashes, page codecs,
the Redis page index, the UCX wire protocol, configuration, the embedded Valkey
launcher and the ``kvstore`` command line."""

from kvstore.errors import (
    FencedError,
    IndexScriptError,
    IndexUnavailableError,
    InvalidInputError,
    KVStoreError,
    NodeIdInUseError,
    ProtocolError,
    RemoteFault,
    TransportError,
)
from kvstore.pages.hashing import block_hash_bytes, block_hashes, part_hashes, sequence_hash
from kvstore.pages.namespace import Namespace

__all__ = [
    "FencedError",
    "IndexScriptError",
    "IndexUnavailableError",
    "InvalidInputError",
    "KVStoreError",
    "Namespace",
    "NodeIdInUseError",
    "ProtocolError",
    "RemoteFault",
    "TransportError",
    "block_hash_bytes",
    "block_hashes",
    "part_hashes",
    "sequence_hash",
]
