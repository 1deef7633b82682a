"""Exception types shared by the client, the server and the index.

Misuse (bad arguments) raises ``InvalidInputError``, which is also a ``ValueError``
so callers that only know the standard library can still catch it. Remote faults
raise the other types; the client turns them into misses instead of raising."""


class KVStoreError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument is malformed: wrong shape, dtype, hash length, an empty list..."""


class UnknownNamespaceError(KVStoreError, LookupError):
    """The namespace digest was never registered in the index."""


class IndexUnavailableError(KVStoreError, ConnectionError):
    """Redis/Valkey could not be reached or answered with a transport error."""


class TransportError(KVStoreError):
    """A storage node could not be reached, timed out or broke the protocol."""


class ProtocolError(KVStoreError):
    """A frame on the data plane is malformed, truncated or too large."""
