"""UCX (ucxx) set-up shared by storage nodes and clients.

ucxx keeps one context per process; ``ensure_ucx`` initialises it once, in the
caller's event loop thread, with the progress mode chosen by settings. Blocking
progress is the default: it idles at no CPU cost and measured fastest on loopback
TCP (shared/reference/ucx.md has the figures for the other modes)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np

from kvstore import protocol as P
from kvstore.errors import TransportError

# Defaults applied only where the environment does not set them already.
UCX_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Without it a killed node's listener port stays busy for about 60 s (TIME_WAIT),
    # so a restarted pod or hostNetwork node could not come back on its port.
    "UCX_TCP_CM_REUSEADDR": "y",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_RNDV_THRESH": "256k",
}
_lock = threading.Lock()
_initialised: str | None = None


def ensure_ucx(progress_mode: str = "blocking") -> Any:
    """Initialise ucxx once per process and return the module.

    Must be called from the thread whose event loop will drive transfers."""
    global _initialised
    with _lock:
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import ucxx

        if _initialised is None:
            ucxx.init(progress_mode=progress_mode)
            _initialised = progress_mode
        return ucxx


def cuda_capable() -> bool:
    """True when the loaded UCX can move CUDA device memory itself (cuda_copy/cuda_ipc)."""
    try:
        import ucxx

        return any(t.startswith("cuda") for t in ucxx.get_active_transports())
    except Exception:  # noqa: BLE001 - no CUDA driver or no UCX context: not capable
        return False


async def with_timeout(awaitable: Any, seconds: float, what: str) -> Any:
    """Await with a deadline; a timeout becomes ``TransportError`` naming the step."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise TransportError(f"{what} timed out after {seconds:.1f} s") from None


async def send_frame(ep: Any, frame: Any) -> None:
    """Send one control frame as tagged messages (see ``kvstore.protocol``)."""
    for message in P.wire_messages(frame):
        await ep.send(np.frombuffer(message, dtype=np.uint8), tag=P.CONTROL_TAG)


async def recv_frame(ep: Any, max_body: int = P.MAX_BODY_BYTES) -> bytes:
    """Receive one control frame's bytes (preamble and body, for ``P.decode``).

    The announced body length is checked against ``max_body`` before anything is
    allocated for it; a bad preamble raises ``ProtocolError`` and leaves the stream
    out of step, so callers close the endpoint. Cancelling this receive is safe only
    if the endpoint is closed afterwards (every caller does)."""
    first = np.zeros(P.FIRST_MESSAGE_BYTES, dtype=np.uint8)
    await ep.recv(first, tag=P.CONTROL_TAG)
    total = P.PREAMBLE.size + P.announced_length(first.data, max_body)
    if total <= P.FIRST_MESSAGE_BYTES:
        return first[:total].tobytes()
    rest = np.empty(total - P.FIRST_MESSAGE_BYTES, dtype=np.uint8)
    await ep.recv(rest, tag=P.CONTROL_TAG)
    return first.tobytes() + rest.tobytes()
