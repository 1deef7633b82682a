"""Exception types shared by the client, the server and the index.

Two families that callers must tell apart:
- usage errors (``InvalidInputError``, also a ``ValueError``): the caller passed
  something malformed. They always propagate.
- remote faults (``RemoteFault`` and its subclasses): a node, the index or the
  network failed. The client turns them into misses or shorter prefixes.

``IndexScriptError`` is neither: the index rejected a script call, which means a bug
or an incompatible server. Reads still count it as a miss (the engine must keep
running), but it is logged at ERROR and counted separately."""


class KVStoreError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument is malformed: wrong shape, dtype, hash length, an empty list..."""


class RemoteFault(KVStoreError):
    """A remote component (index, storage node, network) failed; never the caller's fault."""


class IndexUnavailableError(RemoteFault, ConnectionError):
    """Redis/Valkey could not be reached or answered with a transport error."""


class FencedError(RemoteFault):
    """A storage node acted under an incarnation the index no longer accepts (another
    process took over its node id, or the index lost its registration)."""


class TransportError(RemoteFault):
    """A storage node could not be reached, timed out or refused the request."""


class ProtocolError(RemoteFault):
    """A frame on the data plane is malformed, truncated or too large."""


class IndexScriptError(KVStoreError):
    """The index answered a script call with an error: a bug, not a fault to hide."""


class NodeIdInUseError(KVStoreError):
    """Another live storage node is registered under the same node id."""
