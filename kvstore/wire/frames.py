"""The control frames of the data-plane protocol (docs/protocol.md): one pydantic model
per frame type, holding and validating what that frame says. Encoding them on the
wire is ``kvstore.wire.protocol``'s job; callers import both from there."""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.keys import SEGMENT_PAGES
from kvstore.pages.namespace import Tenant
from kvstore.wire.runs import DEFAULT_MAX_RUN_BYTES

MAX_PAGES_PER_REQUEST = 65_536
# token ids a put may carry (4 bytes each): 8,192 pages of 256 tokens; the body's own
# limit (MAX_BODY_BYTES) bounds them first
MAX_TOKEN_IDS = 1 << 21

# namespace digests: 16 bytes as lowercase hex
Hex128 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
# Kinds of binary array that follow a frame's JSON header: (numpy dtype, bytes per row).
ARRAY_TYPES: dict[str, tuple[str, int]] = {
    "u32": ("<u4", 4),
    "u64": ("<u8", 8),
    "bool": ("u1", 1),
    "hash": ("u1", HASH_BYTES),
}


class FrameType(enum.IntEnum):
    """The frame type a preamble names: which model the body decodes into."""

    PUT_REQUEST = 1
    PUT_PLAN = 2
    PUT_RESULT = 3
    GET_REQUEST = 4
    GET_PLAN = 5
    PUT_CHECKSUMS = 6
    GET_DONE = 7
    SLOT_READS = 8
    ERROR = 15


def _as_array(name: str, value: Any, kind: str) -> np.ndarray:
    """``value`` as the packed array of ``kind`` a frame field holds; raises
    ``ValueError`` (a validation error of the frame) when it cannot be one."""
    dtype, _ = ARRAY_TYPES[kind]
    if kind == "hash":
        if (
            isinstance(value, np.ndarray)
            and value.dtype == np.uint8
            and value.ndim == 2
            and value.shape[1] == HASH_BYTES
        ):
            return value
        try:
            joined = b"".join(value)
        except TypeError:
            joined = b""
        if len(joined) != HASH_BYTES * len(value):
            raise ValueError(f"{name} must be {HASH_BYTES}-byte hashes")
        return np.frombuffer(joined, dtype=np.uint8).reshape(-1, HASH_BYTES)
    arr = np.asarray(value)
    if arr.ndim == 1 and arr.dtype == dtype:  # decoded from the wire: in range by its type
        return arr
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise ValueError(f"{name} must be a flat integer array")
    if arr.size and (int(arr.min()) < 0 or (kind == "u32" and int(arr.max()) >= 2**32)):
        raise ValueError(f"{name} holds a value out of range for {kind}")
    return arr.astype(dtype, copy=False)


class _Frame(BaseModel):
    """Base of every control frame: validates its fields. Scalar fields travel as a JSON
    header, the per-page fields named in ``ARRAYS`` as packed little-endian arrays after
    it (numpy arrays here, built from lists, tuples or arrays)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    ARRAYS: ClassVar[dict[str, str]] = {}
    # fields an older peer neither sends nor reads, left off the wire at their default
    # (the frame's bytes are then what they were before the field existed): trailing
    # arrays while empty, read as empty when the body ends before them; scalars while
    # at their default, which a header without them reads as
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    ROWS: ClassVar[dict[str, int]] = {}  # rows an array may hold, when not MAX_PAGES_PER_REQUEST

    @model_validator(mode="before")
    @classmethod
    def _arrays(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for name, kind in cls.ARRAYS.items():
                data[name] = _as_array(name, data.get(name, ()), kind)
        return data

    def ints(self, name: str) -> list[int]:
        """A numeric array field as a list of Python ints."""
        return getattr(self, name).tolist()


def _same_length(frame: _Frame, *names: str) -> None:
    if len({len(getattr(frame, n)) for n in names}) > 1:
        raise ValueError(f"{', '.join(names)} must have the same length")


Array = Any  # a numpy array, checked by _Frame._arrays


class PutRequest(_Frame):
    """Client -> server: pages the client offers to store (hash, size, whether each page
    may share a message with the one before it, and its place in the index: segment
    anchor and position, see ``kvstore.pages.keys``), and optionally the token ids of
    each page's block (the same number per page, page after page), which the node
    keeps with the page for its KV events. Only a node that advertises ``put_tokens``
    in its registry entry gets them: an older node refuses a frame that carries them."""

    ARRAYS = {
        "hashes": "hash",
        "sizes": "u64",
        "join": "bool",
        "anchors": "hash",
        "positions": "u32",
        "token_ids": "u32",
    }
    OPTIONAL = frozenset({"token_ids"})
    ROWS = {"token_ids": MAX_TOKEN_IDS}
    namespace: Hex128
    tenant: Tenant
    token: str = ""
    hashes: Array
    sizes: Array
    join: Array
    anchors: Array
    positions: Array
    token_ids: Array = None  # empty: none sent (an older client, or an older node)

    @model_validator(mode="after")
    def _check(self) -> PutRequest:
        _same_length(self, "hashes", "sizes", "join", "anchors", "positions")
        if len(self.token_ids) % max(len(self.hashes), 1):
            raise ValueError(
                f"{len(self.token_ids)} token ids are not the same number for each of {len(self.hashes)} pages"
            )
        if not 1 <= len(self.hashes) <= MAX_PAGES_PER_REQUEST:
            raise ValueError(
                f"a put offers 1 to {MAX_PAGES_PER_REQUEST} pages, got {len(self.hashes)}"
            )
        if int(self.sizes.min()) == 0:
            raise ValueError("page sizes must be positive")
        if int(self.positions.max()) >= SEGMENT_PAGES:
            raise ValueError(f"page positions in their segments must lie in [0, {SEGMENT_PAGES})")
        return self


class PutPlan(_Frame):
    """Server -> client: which offered pages to send, grouped into runs (lengths, in order
    of ``wanted``) that each travel as one message; ``present`` were already stored;
    ``refused`` did not fit. Same-host puts move no messages: ``regions`` (slab indexes)
    and ``offsets`` (within the slab) say which slot the client writes each wanted page
    into, with writable descriptors as in ``GetPlan`` (see kvstore.wire.shm)."""

    ARRAYS = {
        "wanted": "u32",
        "runs": "u32",
        "present": "u32",
        "refused": "u32",
        "regions": "u32",
        "offsets": "u64",
    }
    wanted: Array
    runs: Array
    present: Array
    refused: Array
    regions: Array
    offsets: Array
    mapped: list[tuple[int, int]] = []
    more: bool = False


class PutChecksums(_Frame):
    """Client -> server, after PUT_PLAN: the xxh3-64 of each wanted page, in the order
    of ``wanted``. Pages the node did not ask for are never hashed."""

    ARRAYS = {"checksums": "u64"}
    checksums: Array


class PutResult(_Frame):
    """Server -> client after the payloads: which wanted pages are now committed."""

    ARRAYS = {"stored": "u32", "corrupt": "u32"}
    stored: Array
    corrupt: Array


class GetRequest(_Frame):
    """Client -> server: pages the client asks for (hash, and whether each page may
    share a message with the one before it), and the largest run it takes. On the same
    host, ``part_pages`` (sent only to a node that advertises ``get_parts``: an older
    node refuses the field) asks for the plan in parts of that many pages, so the
    client copies one part while the node plans the next; 0: one plan."""

    ARRAYS = {"hashes": "hash", "join": "bool"}
    OPTIONAL = frozenset({"part_pages"})
    namespace: Hex128
    tenant: Tenant
    token: str = ""
    hashes: Array
    join: Array
    max_run_bytes: int = Field(default=DEFAULT_MAX_RUN_BYTES, gt=0)
    # a client's warm-up at start (connection, the node's first look at the namespace
    # and credential): answered like any get, left out of the node's counters
    probe: bool = False
    part_pages: int = Field(default=0, ge=0, le=MAX_PAGES_PER_REQUEST)

    @model_validator(mode="after")
    def _check(self) -> GetRequest:
        _same_length(self, "hashes", "join")
        if not 1 <= len(self.hashes) <= MAX_PAGES_PER_REQUEST:
            raise ValueError(
                f"a get asks for 1 to {MAX_PAGES_PER_REQUEST} pages, got {len(self.hashes)}"
            )
        return self


class GetPlan(_Frame):
    """Server -> client: ``present`` pages follow as runs (lengths, in order of ``present``);
    ``sizes`` and ``checksums`` are the server's record of each present page. Same-host
    gets move no messages: ``regions`` (slab indexes) and ``offsets`` (within the slab)
    say where each page lies in the node's shared memory, and the frame carries a
    read-only descriptor for each ``mapped`` [slab, generation] the client lacks; with
    more descriptors than one frame can carry, frames with ``more`` set come first
    (see kvstore.wire.shm). A plan asked for in parts (``GetRequest.part_pages``) is
    such frames too, each listing the pages of its part; the last has ``more`` unset.
    A frame's pages are its own: a client reads each frame's arrays as it arrives."""

    ARRAYS = {
        "present": "u32",
        "sizes": "u64",
        "checksums": "u64",
        "runs": "u32",
        "regions": "u32",
        "offsets": "u64",
    }
    mapped: list[tuple[int, int]] = []
    more: bool = False
    present: Array
    sizes: Array
    checksums: Array
    runs: Array
    regions: Array
    offsets: Array


class GetDone(_Frame):
    """Client -> server after a same-host GET_PLAN: the pages are copied; unpin them."""


class SlotReads(_Frame):
    """Client -> server, on the same host, answered by nothing: the client copied these
    pages of ``namespace`` straight from the slots the index places them in, out of slabs
    it had mapped, without a plan (sent only to a node whose registry entry has
    ``slab_bytes``). The node counts them as read and marks them recently used; a page
    it no longer holds is passed over. A notice it refuses closes the connection
    (``unauthorized``) or is dropped: never an ERROR reply, which the client's next
    request would read as its own."""

    ARRAYS = {"hashes": "hash"}
    namespace: Hex128
    tenant: Tenant
    token: str = ""
    hashes: Array

    @model_validator(mode="after")
    def _check(self) -> SlotReads:
        if not 1 <= len(self.hashes) <= MAX_PAGES_PER_REQUEST:
            raise ValueError(
                f"a slot-read notice names 1 to {MAX_PAGES_PER_REQUEST} pages, got {len(self.hashes)}"
            )
        return self


# Not StrEnum: str() of a (str, Enum) member is "RefusalCode.X", of a StrEnum member the value.
class RefusalCode(str, enum.Enum):  # noqa: UP042
    """Why a node answered ERROR (docs/protocol.md); on the wire, the value."""

    PROTOCOL = "protocol"  # a malformed or out-of-step frame
    UNAUTHORIZED = "unauthorized"  # the token matches no credential; the node closes the connection
    FORBIDDEN = "forbidden"  # the credential lacks the right on the namespace's tenant
    TOO_LARGE = "too_large"  # more pages than --max-request-pages
    # the index does not know the namespace (under that tenant)
    UNKNOWN_NAMESPACE = "unknown_namespace"
    INDEX_UNAVAILABLE = "index_unavailable"  # the node could not read the namespace from the index
    SHUTTING_DOWN = "shutting_down"  # the node is stopping


class ErrorFrame(_Frame):
    """Server -> client: the node refuses the request (``code``), saying why."""

    code: RefusalCode
    message: str
