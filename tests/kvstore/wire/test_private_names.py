"""The private names of other packages that kvstore still uses, each because no public
interface does the job (the comment beside each use says why). Each test fails when
the name moves or stops doing what kvstore relies on, so an upgrade shows here first
instead of as a slow copy loop, a noisy idle process or a process that hangs at exit.

- asyncio's ``loop._selector`` (kvstore/wire/loop_progress.py): the ``loop`` progress
  mode wraps it to progress UCX before the loop sleeps;
- ucxx's ``_lib_async`` (kvstore/wire/ucxx_progress.py): where ucxx looks up the class
  of its thread progress mode;
- ``threading._register_atexit`` (kvstore/wire/transport.py): stops ucxx's notifier
  thread before the interpreter joins it;
- ucxx's ``core._ctx`` (kvstore/wire/ucxx_progress.py): wakes that thread's wait first, so
  the stop takes milliseconds, not up to a second;
- ``xxhash._xxhash`` (kvstore/pages/checksum.py): the extension whose XXH3 functions
  the C copy loop calls."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import xxhash

from kvstore.pages import checksum
from kvstore.wire import loop_progress, ucxx_progress


class _CountingProgress:
    """Stands in for ``LoopProgress`` (not for UCX): counts the selects it is asked
    about and lets the loop sleep as it would have."""

    def __init__(self) -> None:
        self.selects = 0

    def before_select(self, timeout: float | None) -> float | None:
        self.selects += 1
        return timeout


def test_asyncio_selector_loops_select_through_their_selector_attribute() -> None:
    """LoopProgress swaps ``loop._selector`` for a wrapper: the loop must keep selecting
    through that attribute, and the wrapper must hand on what else the loop asks of it."""
    loop = asyncio.new_event_loop()
    try:
        original = loop._selector  # type: ignore[attr-defined]
        progress = _CountingProgress()
        loop._selector = loop_progress._ProgressingSelector(original, progress)  # type: ignore[attr-defined, arg-type]
        assert loop.run_until_complete(asyncio.sleep(0.01, result="slept")) == "slept"
        assert progress.selects >= 2  # the sleep's own select and the wake-up's
        assert loop._selector.get_map() is original.get_map()  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_ucxx_builds_its_thread_mode_from_the_global_kvstore_replaces() -> None:
    """ucxx must still instantiate the module global ``ThreadMode`` (read at call time,
    so ``use_thread_mode`` takes effect), with the constructor LoopProgress mirrors and
    a progress thread whose epoll timeout QuietThreadMode can set."""
    application_context, thread_mode = ucxx_progress.thread_mode_hook()
    assert (
        "ThreadMode"
        in application_context.ApplicationContext.continuous_ucx_progress.__code__.co_names
    )
    # in a process that already set up UCX the global is kvstore's own class
    assert application_context.ThreadMode in (
        thread_mode,
        loop_progress.LoopProgress,
    ) or issubclass(application_context.ThreadMode, thread_mode)
    constructor = ["worker", "event_loop"]
    assert list(inspect.signature(thread_mode).parameters)[:2] == constructor
    assert list(inspect.signature(loop_progress.LoopProgress).parameters)[:2] == constructor
    from ucxx._lib import libucxx

    assert "epoll_timeout" in inspect.signature(libucxx.UCXWorker.start_progress_thread).parameters


@pytest.mark.process
def test_threading_register_atexit_runs_before_non_daemon_threads_are_joined() -> None:
    """A non-daemon thread that waits to be told to stop (as ucxx's notifier does) lets
    the process exit when the stop is registered with ``threading._register_atexit``."""
    script = textwrap.dedent(
        """
        import threading
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="waits-to-be-told").start()
        threading._register_atexit(stop.set)
        print("main done", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "main done"


@pytest.mark.process
def test_ucxx_context_wakes_and_stops_its_notifier_at_exit() -> None:
    """kvstore's exit hook reaches ucxx's notifier through ``ucxx.core._ctx`` (its
    ``notifier_thread`` and ``worker.stop_request_notifier_thread``): a process that
    used UCX exits at once, and prints nothing after its own last line (ucxx's warning
    about the woken thread stays below ``UCXX_LOG_LEVEL``'s default)."""
    script = textwrap.dedent(
        """
        from kvstore.wire.transport import ensure_ucx
        ensure_ucx()
        import ucxx
        ctx = ucxx.core._ctx
        assert ctx.notifier_thread.is_alive()
        assert callable(ctx.worker.stop_request_notifier_thread)
        print("last line", flush=True)
        """
    )
    for _ in range(5):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "last line" and "UCX" not in done.stderr, done


def test_xxhash_extension_is_where_the_copy_loop_finds_xxh3() -> None:
    """The C copy loop binds to the XXH3 functions of ``xxhash._xxhash``, the extension
    xxhash itself loaded, and gives xxhash's digests."""
    extension: Any = importlib.import_module("xxhash._xxhash")
    assert extension.xxh3_64_intdigest is xxhash.xxh3_64_intdigest
    from kvstore.pages import _copyhash

    assert _copyhash.bind(extension.__file__) is True
    assert checksum._copy_loop is not None  # bound at import, digests checked there
