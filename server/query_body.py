"""The body of ``POST /v1/kv/query`` in its three forms, decoded into ``QueryParams`` and
the token ids as a u32 array (server/query.py answers it).

- JSON with ``token_ids``, a list: parsed by simdjson, whose array lands in a buffer
  without a Python int per id. 131,072 ids took 4.9 ms through pydantic and numpy
  (3.0 ms to parse, 1.9 ms to make the array) and 1.3 ms this way (measured here).
- JSON with ``token_ids_b64``, their little-endian u32 bytes in base64: decoded by
  pybase64 (SIMD), 0.02 ms for those 131,072 ids against 0.8 ms for the standard
  library's ``base64`` (measured here).
- The binary form: the ids as the body (``Content-Type: application/octet-stream``),
  the other fields in the query string. Nothing to parse.

Every error is a ``ValueError`` (or pydantic's ``ValidationError``) naming the field."""

from __future__ import annotations

import binascii
import threading
from urllib.parse import parse_qsl

import numpy as np
import pybase64
import simdjson
from pydantic import BaseModel, ConfigDict, Field

from kvstore.pages.namespace import TENANT_PATTERN

TOKEN_FIELDS = ("token_ids", "token_ids_b64")
# One parser per HTTP thread, kept: it reuses its buffers (a parser made per request
# allocated them afresh, and in the node a 131,072-id list then took 5.8 ms, not 3.0)
_parsers = threading.local()


class QueryParams(BaseModel):
    """What a prefix query names besides its tokens. ``lora_name`` and ``cache_salt``
    key blocks as ``RequestIdentity``'s ``adapter`` and ``cache_salt`` do (the vLLM
    connector's adapter identity is the name, a NUL and a fingerprint of the adapter's
    files: pass that string). The JSON body holds these beside ``token_ids`` (a list)
    or ``token_ids_b64`` (their little-endian u32 bytes in base64); the binary form's
    query string holds them alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    lora_name: str | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, min_length=1)
    block_size: int | None = Field(None, gt=0, description="only namespaces of this block size")
    tenant: str = Field("default", pattern=TENANT_PATTERN)
    # each namespace's answer lists the blocks the answering node holds (tier, pin)
    residency: bool = False


def binary_query(query_string: str, body: bytes) -> tuple[QueryParams, np.ndarray]:
    """The binary form: fields from the query string, the body the ids as u32."""
    params = QueryParams.model_validate(dict(parse_qsl(query_string, strict_parsing=True)))
    if len(body) % 4:
        raise ValueError(f"the body holds {len(body)} bytes, not whole u32 token ids")
    return params, np.frombuffer(body, dtype="<u4")


def json_query(body: bytes) -> tuple[QueryParams, np.ndarray]:
    """The JSON form: its fields, and its token ids as u32 (exactly one of the two
    token fields must be given)."""
    try:
        doc = _parse(body)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    try:
        if not isinstance(doc, simdjson.Object):
            raise ValueError("the body must be a JSON object")
        given = [name for name in TOKEN_FIELDS if name in doc]
        if len(given) != 1:
            raise ValueError("give token_ids or token_ids_b64 (one of them)")
        tokens = _token_list(doc["token_ids"], body) if given[0] == "token_ids" else _token_b64(doc)
        fields = {k: _plain(doc[k]) for k in doc if k not in TOKEN_FIELDS}
    finally:
        del doc  # the parser's buffers are freed with the last element that refers to them
    return QueryParams.model_validate(fields), tokens


def _parse(body: bytes) -> object:
    """``body`` parsed by this thread's parser; by a new one when an element of the
    last parse is still alive (a kept exception's frames can hold one), which the old
    parser refuses."""
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = simdjson.Parser()
    try:
        return parser.parse(body)
    except RuntimeError as exc:
        if "re-use a parser" not in str(exc):
            raise
    parser = _parsers.parser = simdjson.Parser()
    return parser.parse(body)


def _token_list(value: object, body: bytes) -> np.ndarray:
    if not isinstance(value, simdjson.Array):
        raise ValueError("token_ids must be a list of integers")
    # as_buffer flattens nested lists ([[1], [2]] gives 1, 2): a body with a second "["
    # (rare: a nested list, or a bracket in some string) is checked element by element
    if body.count(b"[") > 1 and any(type(x) is not int for x in value.as_list()):
        raise ValueError("token_ids must be a list of integers")
    try:
        ids = np.frombuffer(value.as_buffer(of_type="u"), dtype=np.uint64)
    except (ValueError, RuntimeError):  # negative, or past 64 bits
        raise ValueError("token ids must lie in [0, 2**32)") from None
    except TypeError:
        raise ValueError("token_ids must be a list of integers") from None
    if ids.size and int(ids.max()) >= 2**32:
        raise ValueError("token ids must lie in [0, 2**32)")
    return ids.astype("<u4")


def _token_b64(doc: simdjson.Object) -> np.ndarray:
    text = doc["token_ids_b64"]
    if not isinstance(text, str):
        raise ValueError("token_ids_b64 must be a string")
    try:
        raw = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"token_ids_b64 is not base64: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"token_ids_b64 holds {len(raw)} bytes, not whole u32 ids")
    return np.frombuffer(raw, dtype="<u4")


def _plain(value: object) -> object:
    """A field's value as plain Python (simdjson hands containers as views)."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value
