"""Core library of the KV-cache store: namespaces and block hashes, page codecs,
the Redis page index, the UCX wire protocol, configuration, the embedded Valkey
launcher and the ``kvstore`` command line."""

from kvstore.errors import (
    FencedError,
    IndexScriptError,
    IndexTimeoutError,
    IndexUnavailableError,
    InvalidInputError,
    KVStoreError,
    NodeIdInUseError,
    ProtocolError,
    RemoteFault,
    TransportError,
)
from kvstore.pages.hashing import block_hash_bytes, block_hashes, part_hashes, sequence_hash
from kvstore.pages.identity import BlockExtras, MultimodalItem, RequestIdentity
from kvstore.pages.namespace import Namespace

__all__ = [
    "BlockExtras",
    "FencedError",
    "IndexScriptError",
    "IndexTimeoutError",
    "IndexUnavailableError",
    "InvalidInputError",
    "KVStoreError",
    "MultimodalItem",
    "Namespace",
    "NodeIdInUseError",
    "ProtocolError",
    "RemoteFault",
    "RequestIdentity",
    "TransportError",
    "block_hash_bytes",
    "block_hashes",
    "part_hashes",
    "sequence_hash",
]
