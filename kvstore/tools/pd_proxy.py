"""``kvstore pd-proxy``: an OpenAI-compatible front for disaggregated prefill and decode
(xPyD), speaking vLLM's P/D convention, so the engines behind it need nothing but the
connector (docs/vllm-connector.md, "Disaggregated prefill/decode").

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill
server as vLLM's own proxies send it (``kv_transfer_params: {"do_remote_decode": true}``,
``max_tokens`` 1, not streamed), then to a decode server with the prefill response's
``kv_transfer_params`` passed on verbatim; the decode's answer, streamed or not, goes
back to the caller as it comes. A prefill server is picked by load (requests in flight),
a decode by load and then by the prompt's locality (rendezvous hashing of its start, so
a shared prefix keeps meeting the decode whose own prefix cache holds it). A prefill
that fails leaves the decode without params: it computes the prompt itself.

Built on FastAPI, uvicorn and httpx, which vLLM installs; imported only when the
command runs, so the core package does not need them."""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at
# run time, and Request is imported inside build_app (only when the command runs).
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidInputError

log = logging.getLogger("kvstore.pd_proxy")

# What vLLM's P/D proxies send a prefill (its NIXL connector's toy proxy): the keys a
# connector of another kind expects are there too, empty.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Characters of a prompt whose hash picks among equally loaded decodes.
LOCALITY_CHARS = 512


@dataclass
class Backend:
    url: str
    in_flight: int = 0


def parse_urls(text: str, what: str) -> list[Backend]:
    """``--prefill``/``--decode``: comma-separated http(s) URLs."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise InvalidInputError(f"--{what} names no server")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise InvalidInputError(f"--{what}: {url!r} is not an http:// or https:// URL")
    return [Backend(url) for url in urls]


def pick(backends: list[Backend], key: str = "") -> Backend:
    """The least loaded backend; among those, the highest rendezvous hash of ``key``."""
    least = min(b.in_flight for b in backends)

    def score(b: Backend) -> bytes:
        return hashlib.blake2b(f"{b.url}\0{key}".encode(), digest_size=8).digest()

    return max((b for b in backends if b.in_flight == least), key=score)


def prompt_key(body: dict[str, Any]) -> str:
    """The start of a request's prompt (completions) or messages (chat), for locality."""
    prompt = body.get("prompt", body.get("messages", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return text[:LOCALITY_CHARS]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a prefill server gets it: one token, not streamed, handing over."""
    out = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def build_app(prefills: list[Backend], decodes: list[Backend], timeout_s: float) -> Any:
    """The proxy's FastAPI application."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvstore pd-proxy", lifespan=lifespan)

    async def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The prefill's kv_transfer_params, or None when it failed (logged)."""
        backend = pick(prefills)
        backend.in_flight += 1
        try:
            response = await client.post(
                backend.url + path, json=prefill_body(body), headers=headers
            )
            if response.status_code != 200:
                log.warning(
                    "prefill %s answered %d: the decode computes the prompt itself (%s)",
                    backend.url,
                    response.status_code,
                    response.text[:200],
                )
                return None
            return response.json().get("kv_transfer_params")
        except httpx.HTTPError as exc:
            log.warning(
                "prefill %s failed: the decode computes the prompt itself (%r)", backend.url, exc
            )
            return None
        finally:
            backend.in_flight -= 1

    async def relay(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the request body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the request body is not a JSON object"}, status_code=400)
        request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth
        params = await prefill(path, body, headers)
        decode_body = {**body, "kv_transfer_params": params} if params else body
        backend = pick(decodes, prompt_key(body))
        backend.in_flight += 1
        try:
            upstream = await client.send(
                client.build_request("POST", backend.url + path, json=decode_body, headers=headers),
                stream=True,
            )
        except httpx.HTTPError as exc:
            backend.in_flight -= 1
            return JSONResponse({"error": f"decode {backend.url} failed: {exc!r}"}, status_code=502)

        async def passed_on() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                backend.in_flight -= 1

        return StreamingResponse(
            passed_on(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        response = await client.get(pick(decodes).url + "/v1/models")
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one prefill and one decode server answer /health."""
        state: dict[str, dict[str, bool]] = {"prefill": {}, "decode": {}}
        for side, backends in (("prefill", prefills), ("decode", decodes)):
            for b in backends:
                try:
                    ok = (await client.get(b.url + "/health", timeout=5)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                state[side][b.url] = ok
        healthy = all(any(s.values()) for s in state.values())
        return JSONResponse(state, status_code=200 if healthy else 503)

    return app


def run_pd_proxy(prefill: str, decode: str, host: str, port: int, timeout_s: float) -> int:
    """``kvstore pd-proxy``: serve until interrupted."""
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn
    except ImportError:
        raise InvalidInputError(
            "pd-proxy needs fastapi, uvicorn and httpx, which vLLM installs "
            "(pip install -c constraints.txt -e '.[vllm]')"
        ) from None
    app = build_app(parse_urls(prefill, "prefill"), parse_urls(decode, "decode"), timeout_s)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
