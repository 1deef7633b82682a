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
(tests/faults/test_faults.py reproduces both).

Page payloads travel on ``DATA_TAG``, one message per *run* of pages that are
contiguous in the server's pool, so small pages move in few messages and large
pages move without copies.

This module holds the constants and the codec (``encode``, ``wire_messages``,
``announced_length``, ``decode``); the frame models are in ``kvstore.wire.frames`` and
the run rule in ``kvstore.wire.runs``, both importable from here."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from pydantic import ValidationError

from kvstore.errors import ProtocolError, first_problem
from kvstore.pages.hashing import HASH_BYTES

# The frames and the run rule live in modules of their own; callers import them from
# here (``from kvstore.wire import protocol as P``), as before the split.
from kvstore.wire.frames import (
    ARRAY_TYPES,
    MAX_PAGES_PER_REQUEST,
    ErrorFrame,
    FrameType,
    GetDone,
    GetPlan,
    GetRequest,
    PutChecksums,
    PutPlan,
    PutRequest,
    PutResult,
    RefusalCode,
    SlotReads,
    _Frame,
)
from kvstore.wire.runs import DEFAULT_MAX_RUN_BYTES, PACK_BELOW, group_runs, may_share

__all__ = [
    "CONTROL_TAG",
    "DATA_TAG",
    "DEFAULT_MAX_RUN_BYTES",
    "FIRST_MESSAGE_BYTES",
    "FRAME_REST_TIMEOUT",
    "MAGIC",
    "MAX_BODY_BYTES",
    "MAX_PAGES_PER_REQUEST",
    "PACK_BELOW",
    "PREAMBLE",
    "VERSION",
    "ErrorFrame",
    "FrameType",
    "GetDone",
    "GetPlan",
    "GetRequest",
    "PutChecksums",
    "PutPlan",
    "PutRequest",
    "PutResult",
    "RefusalCode",
    "SlotReads",
    "_Frame",
    "announced_length",
    "decode",
    "encode",
    "group_runs",
    "may_share",
    "wire_messages",
]

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

_MODELS: dict[FrameType, type[_Frame]] = {
    FrameType.PUT_REQUEST: PutRequest,
    FrameType.PUT_PLAN: PutPlan,
    FrameType.PUT_CHECKSUMS: PutChecksums,
    FrameType.PUT_RESULT: PutResult,
    FrameType.GET_REQUEST: GetRequest,
    FrameType.GET_PLAN: GetPlan,
    FrameType.GET_DONE: GetDone,
    FrameType.SLOT_READS: SlotReads,
    FrameType.ERROR: ErrorFrame,
}
_TYPES = {model: ftype for ftype, model in _MODELS.items()}
_COUNT = struct.Struct("<I")


def encode(frame: _Frame) -> bytes:
    """Preamble, then the body: a u32 header length, the JSON header, then for each
    field of ``ARRAYS`` in order a u32 row count and the packed rows."""
    fields = type(frame).model_fields
    unset = {
        name
        for name in frame.OPTIONAL
        if name not in frame.ARRAYS and getattr(frame, name) == fields[name].default
    }
    header = frame.model_dump_json(exclude=set(frame.ARRAYS) | unset).encode()
    parts = [b"", _COUNT.pack(len(header)), header]
    for name in frame.ARRAYS:
        arr = np.ascontiguousarray(getattr(frame, name))
        if name in frame.OPTIONAL and not len(arr):
            continue  # optional arrays trail the others: an empty one is left off
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

    def take_bytes(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.body):
            raise ProtocolError(
                f"truncated {self.model.__name__}: {what} runs past the end of the body"
            )
        self.pos += n
        return self.body[self.pos - n : self.pos]

    def fields(self) -> dict[str, Any]:
        name_ = self.model.__name__
        (hlen,) = _COUNT.unpack(self.take_bytes(_COUNT.size, "header length"))
        fields = json.loads(bytes(self.take_bytes(hlen, "header")))
        if not isinstance(fields, dict):
            raise ProtocolError(f"invalid {name_}: the header is not a JSON object")
        for name, kind in self.model.ARRAYS.items():
            dtype, width = ARRAY_TYPES[kind]
            if name in self.model.OPTIONAL and self.pos == len(self.body):
                continue  # an older peer's frame ends before it: the field's default
            (rows,) = _COUNT.unpack(self.take_bytes(_COUNT.size, f"{name} count"))
            limit = self.model.ROWS.get(name, MAX_PAGES_PER_REQUEST)
            if rows > limit:
                raise ProtocolError(f"invalid {name_}: {name} has {rows} rows, more than {limit}")
            arr = np.frombuffer(self.take_bytes(rows * width, name), dtype=dtype)
            fields[name] = arr.reshape(rows, HASH_BYTES) if kind == "hash" else arr
        if self.pos != len(self.body):
            raise ProtocolError(
                f"invalid {name_}: {len(self.body) - self.pos} bytes after the last field"
            )
        return fields
