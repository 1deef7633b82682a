"""HTTP side door of a storage node: /metrics (Prometheus), /healthz, /readyz.

Runs in a daemon thread so scrapes never wait on the event loop; the probes read
plain attributes the node updates."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def start_health_server(host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool]) -> ThreadingHTTPServer:
    """Serve until the process exits; ``server.server_port`` is the bound port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._reply(200, b"ok\n")
            elif self.path == "/readyz":
                ok = ready()
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not registered\n")
            else:
                self._reply(404, b"not found\n")

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
