"""The data-plane wire protocol (documented in docs/protocol.md).

Control frames are a 12-byte preamble (magic, version, frame type, body length)
followed by a JSON body validated by a pydantic model. They travel as tagged UCX
messages on ``CONTROL_TAG``: a first message of exactly ``FIRST_MESSAGE_BYTES``
(preamble, body, zero padding) and, only for bodies that do not fit, a second
message with the rest. The receiver checks the announced length against its limit
before it allocates anything for the rest.

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
import struct
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvstore.errors import ProtocolError

MAGIC = b"KVSP"
VERSION = 2
PREAMBLE = struct.Struct("<4sHHI")
MAX_BODY_BYTES = 8 << 20
FIRST_MESSAGE_BYTES = 4096
# ucxx mixes these with the endpoint's own tag, so they never match another endpoint.
CONTROL_TAG = 0xC0
DATA_TAG = 0xDA
MAX_PAGES_PER_REQUEST = 65_536
DEFAULT_MAX_RUN_BYTES = 64 << 20
# Pages below this size may share a message even when they do not touch in the
# client's memory: one copy through a scratch buffer costs less than a message each.
PACK_BELOW = 256 << 10

# page hashes and namespace digests: 16 bytes as lowercase hex
Hex128 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class FrameType(enum.IntEnum):
    PUT_REQUEST = 1
    PUT_PLAN = 2
    PUT_RESULT = 3
    GET_REQUEST = 4
    GET_PLAN = 5
    ERROR = 15


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PutPage(_Frame):
    hash: Hex128
    size: int = Field(gt=0)
    checksum: int = Field(ge=0, lt=2**64)
    join: bool = Field(default=False, description="may share a message with the previous page")


class PutRequest(_Frame):
    """Client -> server: pages the client offers to store."""

    namespace: Hex128
    token: str = ""
    pages: list[PutPage] = Field(min_length=1, max_length=MAX_PAGES_PER_REQUEST)


class PutPlan(_Frame):
    """Server -> client: which offered pages to send, grouped into runs (lengths, in order
    of ``wanted``) that each travel as one message; ``present`` were already stored;
    ``refused`` did not fit."""

    wanted: list[int]
    runs: list[int]
    present: list[int]
    refused: list[int]


class PutResult(_Frame):
    """Server -> client after the payloads: which wanted pages are now committed."""

    stored: list[int]
    corrupt: list[int]


class GetPage(_Frame):
    hash: Hex128
    join: bool = Field(default=False, description="may share a message with the previous page")


class GetRequest(_Frame):
    namespace: Hex128
    token: str = ""
    pages: list[GetPage] = Field(min_length=1, max_length=MAX_PAGES_PER_REQUEST)
    max_run_bytes: int = Field(default=DEFAULT_MAX_RUN_BYTES, gt=0)


class GetPlan(_Frame):
    """Server -> client: ``present`` pages follow as runs (lengths, in order of ``present``);
    ``sizes`` and ``checksums`` are the server's record of each present page."""

    present: list[int]
    sizes: list[int]
    checksums: list[int]
    runs: list[int]


class ErrorFrame(_Frame):
    code: str
    message: str


_MODELS: dict[FrameType, type[_Frame]] = {
    FrameType.PUT_REQUEST: PutRequest,
    FrameType.PUT_PLAN: PutPlan,
    FrameType.PUT_RESULT: PutResult,
    FrameType.GET_REQUEST: GetRequest,
    FrameType.GET_PLAN: GetPlan,
    FrameType.ERROR: ErrorFrame,
}
_TYPES = {model: ftype for ftype, model in _MODELS.items()}


def encode(frame: _Frame) -> bytes:
    body = frame.model_dump_json().encode()
    return PREAMBLE.pack(MAGIC, VERSION, _TYPES[type(frame)], len(body)) + body


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
        raise ProtocolError(f"frame of {len(first)} bytes is shorter than the {PREAMBLE.size}-byte preamble")
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
    data = bytes(data)
    length = announced_length(data, max_body)
    if len(data) < PREAMBLE.size + length:
        raise ProtocolError(f"truncated frame: preamble announces {length} body bytes, got {len(data) - PREAMBLE.size}")
    ftype = PREAMBLE.unpack_from(data)[2]
    data = data[: PREAMBLE.size + length]
    try:
        model = _MODELS[FrameType(ftype)]
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    try:
        return model.model_validate_json(data[PREAMBLE.size :])
    except ValidationError as exc:
        raise ProtocolError(f"invalid {model.__name__}: {exc.errors()[0]['loc']} {exc.errors()[0]['msg']}") from None


def plan_runs(offsets: list[int], sizes: list[int], joinable: list[bool], max_run_bytes: int) -> list[int]:
    """Group consecutive items into runs that travel as one message each.

    Used by the server on both PUT and GET: item i joins item i-1's run when their
    pool slots touch (``offsets[i-1] + sizes[i-1] == offsets[i]``), the client allowed
    it (``joinable[i]``: the pages touch in its memory too, or are small enough that
    packing beats a message each) and the run stays within ``max_run_bytes``."""
    runs: list[int] = []
    run_len, run_bytes = 0, 0
    for i, (off, size) in enumerate(zip(offsets, sizes)):
        joins = run_len > 0 and joinable[i] and offsets[i - 1] + sizes[i - 1] == off and run_bytes + size <= max_run_bytes
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
