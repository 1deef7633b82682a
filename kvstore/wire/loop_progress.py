"""UCX progress in the event loop's own thread: the ``loop`` progress mode.

``kvstore.wire.transport.ensure_ucx`` installs it for ``ucx_progress_mode = "loop"``
(the default). ucxx's ``thread`` mode progresses the worker in a C++ thread that sleeps
in ``epoll_wait`` on the worker's event fd between rounds of progress; over TCP a large
send is then paced by the socket's writable events, a wake-up at a time. Measured on
loopback TCP (2 cores, 64 MiB messages, medians of 11 after 0.25 s idle and back to
back): sender in ucxx's ``thread`` mode 1.9-2.6 GB/s; sender polling (ucxx's
``polling`` mode, which spins for ever: 100 % of a core idle) 3.9-4.6; this mode 3.3-3.9
(receiver in ``thread`` mode throughout; both ends in this mode 3.9). Polling in a
separate thread (``thread-polling``) reached 3.3-3.5, and keeping the worker's event fd
in the loop's selector while spinning cost the whole gain (2.6-2.7: the selector asks
the worker's epoll instance, which asks the busy socket, every turn).

So, in the loop's thread:
- idle: before the loop sleeps in its selector the worker is progressed and armed, and
  its event fd sits in the selector, so UCX wakes the loop when anything arrives (an
  idle process with a pending receive: 0.02 % of a core); a tick every
  ``TICK_S`` bounds how late anything that raises no event is noticed, as the thread
  mode's epoll timeout did;
- while a send or receive of at least ``SPIN_MIN_BYTES`` is in flight: the event fd
  leaves the selector and every loop turn progresses the worker without sleeping. A
  request spins for at most ``spin_limit(nbytes)``, so a peer that never takes or
  sends its bytes costs a bounded time of a core, then the request waits on events
  like any other.

Requests complete through ucxx's Python futures (its notifier thread), as in thread
mode; ucxx's delayed submission is off (requests are posted by the caller, which is
the loop's thread). A request is posted and progressed in its loop's thread (nodes run one
loop, blocking clients share one; a process running async clients on several loops
has each progress the same worker, which ucxx creates thread-safe)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.wire import ucxx_progress

SPIN_MIN_BYTES = 1 << 20
TICK_S = 0.1
# A request spins for at most its bytes at SPIN_FLOOR_BYTES_PER_S plus SPIN_SLACK_S.
SPIN_FLOOR_BYTES_PER_S = 1 << 30
SPIN_SLACK_S = 0.005

# ucxx makes one progress object per event loop that uses it (a process may run clients
# on more than one loop; the worker takes progress from any thread) and keeps it, with
# its loop, for the process's life (its ProgressTasks); so does this map.
_by_loop: dict[asyncio.AbstractEventLoop, LoopProgress] = {}


def spin_limit(nbytes: int) -> float:
    return nbytes / SPIN_FLOOR_BYTES_PER_S + SPIN_SLACK_S


class _ProgressingSelector:
    """The loop's selector, progressing (and arming, or spinning) before each select."""

    def __init__(self, inner: Any, progress: LoopProgress) -> None:
        self._inner = inner
        self._progress = progress

    def select(self, timeout: float | None = None) -> Any:
        return self._inner.select(self._progress.before_select(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LoopProgress:
    """Stands in for ucxx's ``ThreadMode`` (same constructor), so ucxx keeps thread
    mode's Python futures while no progress thread runs."""

    def __init__(
        self, worker: Any, event_loop: asyncio.AbstractEventLoop, *args: Any, **kwargs: Any
    ) -> None:
        self.worker = worker
        self.event_loop = event_loop
        self.spinning = 0
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        # private: asyncio can take a selector only when a loop is made, and ucxx's loop exists already
        event_loop._selector = _ProgressingSelector(event_loop._selector, self)  # type: ignore[attr-defined]
        self._watching = False
        self._watch(True)
        self._tick()
        _by_loop[event_loop] = self

    def _watch(self, on: bool) -> None:
        if on and not self._watching:
            self.event_loop.add_reader(self._fd, self.worker.progress)
        elif not on and self._watching:
            self.event_loop.remove_reader(self._fd)
        self._watching = on

    def _tick(self) -> None:
        if not self.event_loop.is_closed():
            # wakes the loop; before_select progresses
            self.event_loop.call_later(TICK_S, self._tick)

    def before_select(self, timeout: float | None) -> float | None:
        """Progress the worker; returns the timeout the selector may sleep for: 0 while
        a large request spins or UCX has events to handle, else the loop's own with the
        worker armed."""
        worker = self.worker
        if self.spinning:
            self._watch(False)
            worker.progress()
            return 0
        self._watch(True)
        worker.progress()
        return timeout if worker.arm() else 0

    def spin_while(self, task: asyncio.Future, nbytes: int) -> None:
        """Spin while ``task`` (a request of ``nbytes``) is pending, for at most
        ``spin_limit(nbytes)``."""
        self.spinning += 1
        handle = None

        def stop(_: Any = None) -> None:
            nonlocal handle
            if handle is not None:
                handle.cancel()
                handle = None
                self.spinning -= 1

        handle = self.event_loop.call_later(spin_limit(nbytes), stop)
        task.add_done_callback(stop)


def install() -> None:
    """Make ucxx's thread mode use ``LoopProgress``; ``transport.ensure_ucx`` calls it
    before ``ucxx.init``."""
    ucxx_progress.use_thread_mode(LoopProgress)


def spin_while(task: asyncio.Future, nbytes: int) -> None:
    """Called by ``transport.Channel`` for every request it posts: large ones spin the
    loop's progress while they are in flight (no-op in other progress modes)."""
    if nbytes >= SPIN_MIN_BYTES:
        progress = _by_loop.get(task.get_loop())
        if progress is not None:
            progress.spin_while(task, nbytes)
