"""The data-plane wire protocol (documented in docs/protocol.md).

Control frames are a 12-byte preamble (magic, version, frame type, body length)
followed by a body: a JSON header of the frame's scalar fields (validated by a
pydantic model) and its per-page fields as packed little-endian arrays, so a
request for 8,192 pages encodes in under a millisecond (17 ms as JSON objects).
Over UCX they travel as tagged messages on ``CONTROL_TAG``: a first message of
exactly ``FIRST_MESSAGE_BYTES`` (preamble, body, zero padding) and, only for bodies
that do not fit, a second message with the rest. The receiver checks the announced
length against its limit before it allocates anything for the rest. Over the
same-host Unix socket (kvstore.wire.shm) frames are sent back to back, unpadded.

Why not UCX active messages: ucxx 0.52 keeps an ``am_recv`` waiter that was
cancelled (a client timeout) keyed by the endpoint handle, and the next endpoint
that reuses the handle never receives a frame again; its AM receive pool also
keeps about 2 KiB per closed endpoint. Tagged receives have neither problem
(tests/test_faults.py reproduces both).

Page payloads travel on ``DATA_TAG``, one message per *run* of pages that are
contiguous in the server's pool, so small pages move in few messages and large
pages move without copies."""

from __future__ import annotations

import enum
import json
import struct
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstore.errors import ProtocolError, first_problem
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.keys import SEGMENT_PAGES
from kvstore.pages.namespace import Tenant

MAGIC = b"KVSP"
VERSION = 5
PREAMBLE = struct.Struct("<4sHHI")
MAX_BODY_BYTES = 8 << 20
FIRST_MESSAGE_BYTES = 4096
# Seconds the rest of a control frame may take once its first bytes arrived (a
# sender writes a frame at once; a peer that starts one and stalls is dropped).
FRAME_REST_TIMEOUT = 5.0
# ucxx mixes these with the endpoint's own tag, so they never match another endpoint.
CONTROL_TAG = 0xC0
DATA_TAG = 0xDA
MAX_PAGES_PER_REQUEST = 65_536
DEFAULT_MAX_RUN_BYTES = 64 << 20
# Pages below this size may share a message even when they do not touch in the
# client's memory: one copy through a scratch buffer costs less than a message each.
PACK_BELOW = 256 << 10

# namespace digests: 16 bytes as lowercase hex
Hex128 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
# Kinds of binary array that follow a frame's JSON header: (numpy dtype, bytes per row).
_ARRAY_TYPES: dict[str, tuple[str, int]] = {
    "u32": ("<u4", 4),
    "u64": ("<u8", 8),
    "bool": ("u1", 1),
    "hash": ("u1", HASH_BYTES),
}


class FrameType(enum.IntEnum):
    PUT_REQUEST = 1
    PUT_PLAN = 2
    PUT_RESULT = 3
    GET_REQUEST = 4
    GET_PLAN = 5
    PUT_CHECKSUMS = 6
    GET_DONE = 7
    ERROR = 15


def _as_array(name: str, value: Any, kind: str) -> np.ndarray:
    dtype, _ = _ARRAY_TYPES[kind]
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
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise ValueError(f"{name} must be a flat integer array")
    if arr.size and (int(arr.min()) < 0 or (kind == "u32" and int(arr.max()) >= 2**32)):
        raise ValueError(f"{name} holds a value out of range for {kind}")
    return arr.astype(dtype, copy=False)


class _Frame(BaseModel):
    """A control frame: scalar fields travel as a JSON header, the per-page fields
    named in ``ARRAYS`` as packed little-endian arrays after it (numpy arrays here,
    built from lists, tuples or arrays)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    ARRAYS: ClassVar[dict[str, str]] = {}

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
    anchor and position, see ``kvstore.pages.keys``)."""

    ARRAYS = {
        "hashes": "hash",
        "sizes": "u64",
        "join": "bool",
        "anchors": "hash",
        "positions": "u32",
    }
    namespace: Hex128
    tenant: Tenant
    token: str = ""
    hashes: Array
    sizes: Array
    join: Array
    anchors: Array
    positions: Array

    @model_validator(mode="after")
    def _check(self) -> PutRequest:
        _same_length(self, "hashes", "sizes", "join", "anchors", "positions")
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
    ARRAYS = {"hashes": "hash", "join": "bool"}
    namespace: Hex128
    tenant: Tenant
    token: str = ""
    hashes: Array
    join: Array
    max_run_bytes: int = Field(default=DEFAULT_MAX_RUN_BYTES, gt=0)
    # a client's warm-up at start (connection, the node's first look at the namespace
    # and credential): answered like any get, left out of the node's counters
    probe: bool = False

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
    (see kvstore.wire.shm)."""

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
    code: RefusalCode
    message: str


_MODELS: dict[FrameType, type[_Frame]] = {
    FrameType.PUT_REQUEST: PutRequest,
    FrameType.PUT_PLAN: PutPlan,
    FrameType.PUT_CHECKSUMS: PutChecksums,
    FrameType.PUT_RESULT: PutResult,
    FrameType.GET_REQUEST: GetRequest,
    FrameType.GET_PLAN: GetPlan,
    FrameType.GET_DONE: GetDone,
    FrameType.ERROR: ErrorFrame,
}
_TYPES = {model: ftype for ftype, model in _MODELS.items()}
_COUNT = struct.Struct("<I")


def encode(frame: _Frame) -> bytes:
    """Preamble, then the body: a u32 header length, the JSON header, then for each
    field of ``ARRAYS`` in order a u32 row count and the packed rows."""
    header = frame.model_dump_json(exclude=set(frame.ARRAYS)).encode()
    parts = [b"", _COUNT.pack(len(header)), header]
    for name in frame.ARRAYS:
        arr = np.ascontiguousarray(getattr(frame, name))
        parts += [_COUNT.pack(len(arr)), arr.tobytes()]
    parts[0] = PREAMBLE.pack(MAGIC, VERSION, _TYPES[type(frame)], sum(len(p) for p in parts))
    return b"".join(parts)


def wire_messages(frame: _Frame) -> list[bytes]:
    """The tagged messages that carry ``frame``: the padded first message, then the
    rest of the body if it did not fit."""
    data = encode(frame)
    first = data[:FIRST_MESSAGE_BYTES]
    messages = [first + bytes(FIRST_MESSAGE_BYTES - len(first))]
    if len(data) > FIRST_MESSAGE_BYTES:
        messages.append(data[FIRST_MESSAGE_BYTES:])
    return messages


def announced_length(first: bytes | bytearray | memoryview, max_body: int = MAX_BODY_BYTES) -> int:
    """Body length announced by a first message, checked against ``max_body`` before
    the receiver allocates anything; raises ``ProtocolError`` on a bad preamble."""
    if len(first) < PREAMBLE.size:
        raise ProtocolError(
            f"frame of {len(first)} bytes is shorter than the {PREAMBLE.size}-byte preamble"
        )
    magic, version, _, length = PREAMBLE.unpack_from(first)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}; this build speaks {VERSION}")
    if length > max_body:
        raise ProtocolError(f"frame body of {length} bytes exceeds the {max_body}-byte limit")
    return length


def decode(data: bytes | bytearray | memoryview, max_body: int = MAX_BODY_BYTES) -> _Frame:
    """Parse one control frame (preamble and body; trailing padding is ignored);
    raises ``ProtocolError`` naming what is wrong."""
    model, body = _typed_body(memoryview(data).cast("B"), max_body)
    try:
        return model.model_validate(_BodyReader(model, body).fields())
    except ValidationError as exc:
        name, _, message = first_problem(exc)
        raise ProtocolError(f"invalid {model.__name__}: {name or 'frame'}: {message}") from None
    except ValueError as exc:  # malformed JSON
        raise ProtocolError(f"invalid {model.__name__}: {exc}") from None


def _typed_body(data: memoryview, max_body: int) -> tuple[type[_Frame], memoryview]:
    """The frame model the preamble names and the body it announces, checked whole."""
    length = announced_length(data, max_body)
    if len(data) < PREAMBLE.size + length:
        raise ProtocolError(
            f"truncated frame: preamble announces {length} body bytes, got {len(data) - PREAMBLE.size}"
        )
    ftype = PREAMBLE.unpack_from(data)[2]
    try:
        model = _MODELS[FrameType(ftype)]
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    return model, data[PREAMBLE.size : PREAMBLE.size + length]


class _BodyReader:
    """Reads a body in order: the JSON header, then each of the model's arrays; every
    read is bounded by the body, and nothing may be left after the last array."""

    def __init__(self, model: type[_Frame], body: memoryview) -> None:
        self.model = model
        self.body = body
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.body):
            raise ProtocolError(
                f"truncated {self.model.__name__}: {what} runs past the end of the body"
            )
        self.pos += n
        return self.body[self.pos - n : self.pos]

    def fields(self) -> dict[str, Any]:
        name_ = self.model.__name__
        (hlen,) = _COUNT.unpack(self.take(_COUNT.size, "header length"))
        fields = json.loads(bytes(self.take(hlen, "header")))
        if not isinstance(fields, dict):
            raise ProtocolError(f"invalid {name_}: the header is not a JSON object")
        for name, kind in self.model.ARRAYS.items():
            dtype, width = _ARRAY_TYPES[kind]
            (rows,) = _COUNT.unpack(self.take(_COUNT.size, f"{name} count"))
            if rows > MAX_PAGES_PER_REQUEST:
                raise ProtocolError(
                    f"invalid {name_}: {name} has {rows} rows, more than {MAX_PAGES_PER_REQUEST}"
                )
            arr = np.frombuffer(self.take(rows * width, name), dtype=dtype)
            fields[name] = arr.reshape(rows, HASH_BYTES) if kind == "hash" else arr
        if self.pos != len(self.body):
            raise ProtocolError(
                f"invalid {name_}: {len(self.body) - self.pos} bytes after the last field"
            )
        return fields


def may_share(touching: bool, prev_nbytes: int, nbytes: int, scattered: bool = False) -> bool:
    """The client's side of the rule: a page may travel in one message with the page
    before it when the two touch in the client's memory, when both are scattered
    (each in pieces, as a block of a layer-major paged cache: they go through a
    scratch buffer either way), or when both are below ``PACK_BELOW`` (packed through
    a scratch buffer). Sent as a request's ``join``. Measured for scattered pages, a
    UCX get of 96 pages of 1.25 MiB into a 10-layer cache (the TTFT bench's load),
    medians of 10 gets per process: 57.0-68.2 ms over 5 processes with a message per
    page, 45.1-59.3 ms over 9 sharing messages of up to 64 MiB (16 MiB runs: no better)."""
    return touching or scattered or (nbytes < PACK_BELOW and prev_nbytes < PACK_BELOW)


def group_runs(
    offsets: list[int], sizes: list[int], join: list[bool], indexes: list[int], max_run_bytes: int
) -> list[int]:
    """Group the pages a node sends or receives into runs that travel as one message
    each: the whole rule, applied by the node on both PUT and GET.

    Page k (request item ``indexes[k]``, pool slot ``offsets[k]``) joins page k-1's run
    when the client allowed it (``join[k]``, see ``may_share``), its request predecessor
    is in the run too (a page skipped in between breaks adjacency in the client's
    memory) unless both are small enough to be packed anyway, their pool slots touch,
    and the run stays within ``max_run_bytes``."""
    runs: list[int] = []
    run_len, run_bytes = 0, 0
    for k, (off, size) in enumerate(zip(offsets, sizes)):
        small = k > 0 and size < PACK_BELOW and sizes[k - 1] < PACK_BELOW
        allowed = k > 0 and join[k] and (indexes[k - 1] == indexes[k] - 1 or small)
        joins = (
            run_len > 0
            and allowed
            and offsets[k - 1] + sizes[k - 1] == off
            and run_bytes + size <= max_run_bytes
        )
        if joins:
            run_len += 1
            run_bytes += size
        else:
            if run_len:
                runs.append(run_len)
            run_len, run_bytes = 1, size
    if run_len:
        runs.append(run_len)
    return runs
