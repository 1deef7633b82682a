"""UCX (ucxx) set-up shared by storage nodes and clients.

ucxx keeps one context per process; ``ensure_ucx`` initialises it once, in the
caller's event loop thread, with the progress mode chosen by settings: ``loop`` (the
default, ``kvstore.wire.loop_progress``: progress in the loop's own thread, sleeping
on the worker's events when idle and spinning while a large request is in flight) or
one of ucxx's own modes below. ``loop`` moves large messages over TCP 1.3-1.7x faster
than ``thread`` and idles as quietly (figures in kvstore/wire/loop_progress.py; in
bench/vs_mooncake.py a UCX put of 64 MiB went from 1.78 to 2.19 GB/s and a get from
2.04 to 2.62).

ucxx's own modes:

Measured here (one node, one client process, 128 MiB put then get of 2 MiB pages,
then 5 s idle; CPU of a core while idle; node RSS growth per connect/disconnect):

| mode | put | get | node idle | client idle | per connection |
|---|---|---|---|---|---|
| ``thread`` + ucxx's Python-future notifier | 0.76 s | 0.10 s | 0.010 | 0.010 | 0.8 KiB |
| ``blocking`` | 0.78 s | 0.10 s | 0.99 | 1.00 | 370 B |
| ``thread`` without the notifier | 1.12 s | 0.18 s | 1.01 | 0.01 | |

Why the others spin (read in ucxx 0.52's source, confirmed with strace): ``blocking``
arms the worker once and never again, so its event fd stays readable and every
event-loop turn calls ``worker.progress()``; and without Python futures every
pending request is awaited by ``asyncio.sleep(0)`` in a loop, so a node with a
client connected (one pending receive per connection) never sleeps. ``thread`` mode
progresses the worker in ucxx's C++ thread, which sleeps in ``epoll_wait``, and the
notifier thread completes asyncio futures only when requests finish; so it was the
default before ``loop``, and choosing ``thread`` (or ``loop``) switches the notifier on
(``UCXPY_ENABLE_PYTHON_FUTURE``, unless the environment sets it). It used to keep
10.5 KiB per closed connection: see ``_settled`` for the cycle and its cure.

ucxx starts that thread with a 1 ms ``epoll_wait`` timeout, hard-coded in its
``ThreadMode``, so an idle process still woke 1,000 times a second: measured here,
an idle node 1.9-3.5 % of a core and a client 1.7-3.2 %, each wake-up also taking a
core from whatever else runs (an engine's OpenMP threads). ``_quiet_thread_mode``
starts it with ``PROGRESS_EPOLL_TIMEOUT_MS`` instead: idle 0.3 % and 0-0.1 %, and a
one-page get and a 64-page get as fast as before (5.7-6.1 and 10-12 ms either way,
loopback TCP), since requests and connections wake the thread through the worker's
event fd; the timeout only bounds how late it notices anything that does not.

Same-host clients do not use UCX at all (``kvstore.wire.shm``)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from kvstore.errors import PortInUseError, ProtocolError, TransportError, TransportTimeoutError
from kvstore.wire import loop_progress, ucxx_progress
from kvstore.wire import protocol as P

# Defaults applied only where the environment does not set them already.
UCX_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Without it a killed node's listener port stays busy for about 60 s (TIME_WAIT),
    # so a restarted pod or hostNetwork node could not come back on its port.
    "UCX_TCP_CM_REUSEADDR": "y",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_RNDV_THRESH": "256k",
    # ucxx logs a peer's loss itself ("UCXX ERROR ... Endpoint is not connected"), raw,
    # to the process's stderr (an engine's log), once per endpoint; the transfer's own
    # error reaches our code, which counts it and logs it rate-limited. Measured: a
    # client whose node was killed wrote 3 such lines in 6 s, 0 with this level.
    "UCXX_LOG_LEVEL": "FATAL",
}
_lock = threading.Lock()
_initialised: str | None = None
PROGRESS_EPOLL_TIMEOUT_MS = 100
PROBE_SPIN = 0.002  # seconds Channel._recv_exact yields between probes before it sleeps
log = logging.getLogger(__name__)


class _EpollTimeout:
    """A ucxx worker whose ``start_progress_thread`` uses our epoll timeout; every
    other attribute is the worker's own."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def start_progress_thread(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["epoll_timeout"] = PROGRESS_EPOLL_TIMEOUT_MS
        return self._worker.start_progress_thread(*args[:1], **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


def _quiet_thread_mode() -> None:
    """Make ucxx's thread progress mode start its progress thread with
    ``PROGRESS_EPOLL_TIMEOUT_MS`` (see the module docstring). Wraps ucxx's own
    ``ThreadMode`` rather than copying it, so what else it does survives an upgrade;
    if ucxx no longer has it, the progress thread keeps ucxx's timeout and a warning
    says so."""
    try:
        application_context, thread_mode = ucxx_progress.thread_mode_hook()
    except ImportError as exc:
        log.warning("ucxx's progress thread keeps its own epoll timeout: %s", exc)
        return
    if getattr(application_context, "ThreadMode", None) is not thread_mode:
        log.warning(
            "ucxx's progress thread keeps its own epoll timeout: "
            "application_context.ThreadMode is not continuous_ucx_progress.ThreadMode"
        )
        return

    class QuietThreadMode(thread_mode):  # type: ignore[misc, valid-type]
        """ucxx's ThreadMode, handed a worker whose progress thread uses our epoll timeout."""

        def __init__(self, worker: Any, event_loop: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(_EpollTimeout(worker), event_loop, *args, **kwargs)
            self.worker = worker

    ucxx_progress.use_thread_mode(QuietThreadMode)


def ensure_ucx(progress_mode: str = "loop") -> Any:
    """Initialise ucxx once per process and return the module.

    Must be called from the thread whose event loop will drive transfers."""
    global _initialised
    with _lock:
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if progress_mode == "loop":
            # ucxx's thread mode with LoopProgress in place of its progress thread: its
            # Python futures, and requests posted by the caller (delayed submission
            # would wait for a progress thread that does not run; without the futures
            # every pending request would spin the loop)
            os.environ["UCXPY_ENABLE_DELAYED_SUBMISSION"] = "0"
            os.environ["UCXPY_ENABLE_PYTHON_FUTURE"] = "1"
        # requests complete through ucxx's notifier thread
        notified = progress_mode == "loop" or progress_mode.startswith("thread")
        if notified:
            os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")  # see the module docstring
        import ucxx

        if _initialised is None:
            if progress_mode == "loop":
                loop_progress.install()
            else:
                _quiet_thread_mode()
            ucxx.init(progress_mode="thread" if progress_mode == "loop" else progress_mode)
            _initialised = progress_mode
            if notified:
                # ucxx's notifier thread is not a daemon and runs until it is told to
                # stop, so every process that used UCX would hang at exit. This hook
                # runs when the interpreter shuts threads down, before it joins them.
                # private: the public atexit.register runs only after that join (too late)
                threading._register_atexit(ucxx_progress.stop_notifier)  # type: ignore[attr-defined]
        return ucxx


def listen(ucxx: Any, callback: Any, port: int) -> Any:
    """A ucxx listener on ``port`` (0: any free one) calling ``callback`` per endpoint;
    ``PortInUseError`` when the port is taken (ucxx raises its own busy error)."""
    from ucxx.exceptions import UCXBusyError

    try:
        return ucxx.create_listener(callback, port=port)
    except UCXBusyError as exc:
        raise PortInUseError(f"the UCX port {port} is in use: {exc}") from None


def cuda_capable() -> bool:
    """True when the loaded UCX can move CUDA device memory itself (cuda_copy/cuda_ipc)."""
    try:
        import ucxx

        return any(t.startswith("cuda") for t in ucxx.get_active_transports())
    except Exception:  # no CUDA driver or no UCX context: not capable
        return False


async def with_timeout(awaitable: Any, seconds: float, what: str) -> Any:
    """Await with a deadline; a timeout becomes ``TransportTimeoutError`` naming the step."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise TransportTimeoutError(f"{what} timed out after {seconds:.1f} s") from None


class Channel:
    """One UCX endpoint whose requests are never cancelled from asyncio.

    Cancelling the asyncio side of a pending ucxx request (a timeout) leaves UCX
    holding the buffer and the request: when the endpoint is closed later, UCX
    completes that request into memory Python may already have freed, and clients
    crashed in ``worker.progress()`` (bench/soak.py, nodes stopped past the client
    timeout). So every send and receive runs as its own task behind
    ``asyncio.shield``: a timeout or cancellation only stops the caller's wait, and
    ``close`` aborts the endpoint, which makes UCX cancel every pending request
    (measured: within a millisecond), then waits until each one has finished. After
    ``close`` returns nothing can land in any buffer the channel was given.

    Node and client both use it; ``send_frame``/``recv_frame`` carry control frames
    (see ``kvstore.wire.protocol``), ``send``/``recv`` payloads."""

    CLOSE_WAIT = 5.0  # seconds close waits for cancelled requests (they finish at once)

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self._inflight: set[asyncio.Future] = set()

    def _start(self, op: Any, nbytes: int = 0) -> asyncio.Future:
        task = asyncio.ensure_future(_settled(op))
        self._inflight.add(task)
        task.add_done_callback(self._finished)
        loop_progress.spin_while(task, nbytes)
        return task

    def _finished(self, task: asyncio.Future) -> None:
        self._inflight.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a request nobody waits for any more may fail quietly

    def post_send(self, buffer: Any, tag: int) -> asyncio.Future:
        """Start sending ``buffer`` and return at once, with a future that settles when
        UCX is done with it (``close`` waits for it like any request). Requests are
        posted in the order these calls were made: each is posted by its task's first
        step, and asyncio runs first steps in the order the tasks were created.

        Why not await each request before the next: a completion reaches asyncio
        through ucxx's progress thread, its notifier thread and the event loop, about
        1 ms on two busy cores even when UCX finished the request at once (measured).
        A get of 64 runs that awaited each one paid that 64 times."""
        return self._start(self.ep.send(buffer, tag=tag), getattr(buffer, "nbytes", 0))

    def post_recv(self, buffer: Any, tag: int) -> asyncio.Future:
        """Start receiving into ``buffer``; as ``post_send``. Receives posted for one
        tag match that tag's messages in the order they were sent."""
        return self._start(self.ep.recv(buffer, tag=tag), getattr(buffer, "nbytes", 0))

    def post_frame(self, frame: Any) -> list[asyncio.Future]:
        """``post_send`` the messages of one control frame (see ``kvstore.wire.protocol``)."""
        return [
            self.post_send(np.frombuffer(message, dtype=np.uint8), P.CONTROL_TAG)
            for message in P.wire_messages(frame)
        ]

    async def send(self, buffer: Any, tag: int) -> None:
        await asyncio.shield(self.post_send(buffer, tag))

    async def recv(self, buffer: Any, tag: int) -> None:
        await asyncio.shield(self.post_recv(buffer, tag))

    async def send_frame(self, frame: Any) -> None:
        """Send one control frame as tagged messages (see ``kvstore.wire.protocol``)."""
        await asyncio.shield(asyncio.gather(*self.post_frame(frame)))

    async def recv_frame(
        self,
        max_body: int = P.MAX_BODY_BYTES,
        rest_timeout: float = P.FRAME_REST_TIMEOUT,
        first_timeout: float | None = None,
    ) -> bytes:
        """Receive one control frame's bytes (preamble and body, for ``P.decode``).

        The announced body length is checked against ``max_body`` before anything is
        allocated for it. A bad preamble, a second message that is not exactly as long
        as announced, or one that does not arrive within ``rest_timeout`` of the first
        raises ``ProtocolError`` and leaves the stream out of step, so callers close the
        channel. The first message lands in a zeroed buffer: one shorter than
        ``FIRST_MESSAGE_BYTES`` reads as if it had been padded with zeros, as senders do.
        ``TimeoutError`` when no frame starts within ``first_timeout`` (None: no limit)."""
        first = np.zeros(P.FIRST_MESSAGE_BYTES, dtype=np.uint8)
        await asyncio.wait_for(self.recv(first, P.CONTROL_TAG), first_timeout)
        total = P.PREAMBLE.size + P.announced_length(first.data, max_body)
        if total <= P.FIRST_MESSAGE_BYTES:
            return first[:total].tobytes()
        rest = await self._recv_exact(total - P.FIRST_MESSAGE_BYTES, rest_timeout)
        return first.tobytes() + rest.tobytes()

    async def _recv_exact(self, nbytes: int, seconds: float) -> np.ndarray:
        """The next control message, which must be exactly ``nbytes`` long.

        A tagged receive into a larger buffer completes without saying how much
        arrived (ucxx 0.52 does not expose the received length: measured, a 50-byte
        message into a 100-byte buffer completes and leaves the tail untouched), so the
        message is probed first, which gives its length, and received by its handle.

        The probe polls, only while a frame is half received: the sender posts both
        messages at once, so it is usually there or about to be (a probe takes 6-17
        us). The loop yields to the event loop between probes for the first
        ``PROBE_SPIN`` seconds, then sleeps 1 ms (epoll_wait's resolution: any asyncio
        sleep above 0 costs that), 5 ms after 20 ms. Measured on a 1,024-page UCX get
        over loopback (a 16 KiB request and a 28 KiB plan, each a second message),
        medians of 30 gets, three runs interleaved with the old posted receive:
        yielding 3 times then sleeping 19.8-20.1 ms, yielding about 2 ms 18.1-19.2 ms,
        the posted receive (which cannot tell a short message) 16.6-21.8 ms."""
        started = time.monotonic()
        while True:
            if self.ep is None:
                raise TransportError("channel closed")
            probe = self.ep.tag_probe(tag=P.CONTROL_TAG, remove=True)
            if probe.matched:
                break
            waited = time.monotonic() - started
            if waited >= seconds:
                raise ProtocolError(
                    f"the rest of a control frame ({nbytes} bytes) did not arrive within {seconds:.1f} s"
                )
            await asyncio.sleep(0 if waited < PROBE_SPIN else 0.001 if waited < 0.02 else 0.005)
        # A message taken off the queue must be received (its handle owns it); one of
        # the wrong length is received into a bounded buffer and thrown away.
        buffer = np.empty(min(probe.length, nbytes) or 1, dtype=np.uint8)
        try:
            await asyncio.shield(self._start(self.ep.recv_with_handle(buffer, probe)))
        except TransportError:
            if probe.length <= nbytes:
                raise
            # else UCX truncated the message into the buffer, as asked
        if probe.length != nbytes:
            raise ProtocolError(
                f"a control frame's body arrived with {probe.length} bytes in its second message, "
                f"{nbytes} were announced"
            )
        return buffer

    def abort(self) -> None:
        """Abort the endpoint; UCX cancels its pending requests (``close`` waits for them)."""
        ep, self.ep = self.ep, None
        if ep is not None:
            try:
                ep.abort()
            except Exception:  # already gone
                pass

    async def close(self) -> None:
        """Abort the endpoint and wait until every request it had in flight finished."""
        self.abort()
        pending = set(self._inflight)
        if pending:
            await asyncio.shield(asyncio.wait(pending, timeout=self.CLOSE_WAIT))


async def _settled(op: Any) -> Any:
    """Await one ucxx request; a failure becomes ``TransportError``.

    With ucxx's Python futures (thread progress mode) the C++ request keeps the
    future, the future keeps the exception, and the exception's traceback keeps the
    frames that hold the endpoint, which holds the request: a cycle through C++ that
    Python's collector cannot see. Measured: about 10.5 KiB kept per closed
    connection (the cancelled receive of every connection a node served). Dropping
    the traceback breaks the cycle (370 B per connection, as in blocking mode)."""
    try:
        return await op
    except Exception as exc:  # every UCX failure is a transport failure
        exc.__traceback__ = None
        raise TransportError(f"UCX request failed: {exc!r}") from None


def started(work: Any) -> asyncio.Future:
    """Run the coroutine ``work`` as a task now and return it; node and client start
    a transfer's waits with it before the requests they wait on go out. A task nobody
    awaits any more (its request failed first and the connection closed) fails quietly."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def connect(ucxx: Any, host: str, port: int, seconds: float, what: str) -> Channel:
    """A channel to ``host:port`` within ``seconds``. On a timeout or cancellation the
    handshake is left to finish (ucxx's own receive must not be cancelled either) and
    an endpoint it produces late is aborted."""
    task = asyncio.ensure_future(ucxx.create_endpoint(host, port))
    try:
        return Channel(await asyncio.wait_for(asyncio.shield(task), seconds))
    except BaseException as exc:
        task.add_done_callback(_abort_late_endpoint)
        if isinstance(exc, asyncio.TimeoutError):
            raise TransportTimeoutError(f"{what} timed out after {seconds:.1f} s") from None
        raise


def _abort_late_endpoint(task: asyncio.Future) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    try:
        task.result().abort()
    except Exception:  # already gone
        pass
