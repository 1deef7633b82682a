"""HTTP side door of a storage node: /metrics (Prometheus), /healthz, /readyz.

Runs in a daemon thread so scrapes never wait on the event loop; the probes read
plain attributes the node updates. /healthz answers from that thread too, so it asks
a ``LoopWatchdog`` whether the event loop itself still runs: a node whose loop is stuck
(a blocking call, a deadlock) fails its liveness probe and is restarted, instead of
looking healthy while it serves nothing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class LoopWatchdog:
    """A task on the node's event loop stamps the time every ``interval`` seconds;
    ``alive()`` (any thread) says whether the last stamp is younger than ``limit``, and
    ``lag`` is how late the last tick ran."""

    def __init__(self, interval: float = 1.0, limit: float = 10.0) -> None:
        self.interval = interval
        self.limit = limit
        self.last_tick = time.monotonic()
        self.lag = 0.0

    def start(self) -> asyncio.Task:
        """Called on the event loop it watches."""
        return asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + self.interval
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            self.lag = max(0.0, now - due)
            self.last_tick = now

    def alive(self) -> bool:
        return time.monotonic() - self.last_tick < self.limit


def start_health_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    ready: Callable[[], bool],
    alive: Callable[[], bool] = lambda: True,
    notes: Callable[[], list[str]] = list,
    post: Callable[[str, bytes, str, str], tuple[int, bytes]] | None = None,
    max_body: int = 16 << 20,
) -> ThreadingHTTPServer:
    """Serve until the process exits; ``server.server_port`` is the bound port. ``notes``
    are lines /healthz adds to its body about a part that is degraded while the node
    still serves (its status stays 200: restarting would not help). ``post``: answers
    POSTs (the prefix query API, server/query.py) as (status, JSON body), given the
    path (with its query string), the body (at most ``max_body`` bytes), and the
    Authorization and Content-Type headers."""

    class Handler(BaseHTTPRequestHandler):
        """Answers the four paths on the HTTP server's thread (reads only plain values)."""

        # keep-alive: a router asking the query API per request reuses its connection
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out in two writes: without this, Nagle holds the body
            # until the client's delayed ACK of the headers, 40 ms on a kept-alive
            # connection (every query answered in 44 ms, measured)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                ok = alive()
                body = ("ok\n" if ok else "event loop stuck\n") + "".join(
                    f"{line}\n" for line in notes()
                )
                self._reply(200 if ok else 503, body.encode())
            elif self.path == "/readyz":
                ok = ready()
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not registered\n")
            else:
                self._reply(404, b"not found\n")

        def do_POST(self) -> None:
            if post is None:
                self._reply(404, b"not found\n")
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(411, b'{"error": "a Content-Length is needed"}', "application/json")
                return
            if not 0 <= length <= max_body:
                self.close_connection = True  # the body is not read
                self._reply(413, b'{"error": "request body too large"}', "application/json")
                return
            status, body = post(
                self.path,
                self.rfile.read(length),
                self.headers.get("Authorization", ""),
                self.headers.get("Content-Type", ""),
            )
            self._reply(status, body, "application/json")

        def _reply(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvstore-health", daemon=True).start()
    return server
