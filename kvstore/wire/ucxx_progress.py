"""ucxx's progress-mode hook and its notifier's stop: the one place kvstore names
ucxx's private ``_lib_async`` and ``core._ctx``.

ucxx builds a thread-mode progress object from the module global
``application_context.ThreadMode`` (in ``ApplicationContext.continuous_ucx_progress``),
and its public ``ucxx.init`` takes only a mode's name. So kvstore's ``loop`` mode
(``kvstore.wire.loop_progress``) and the quiet thread mode (``kvstore.wire.transport``)
each put their own class in that global, through ``use_thread_mode``, before
``ucxx.init``. At exit, ``stop_notifier`` wakes the notifier thread through the
context's worker before it stops it. tests/kvstore/wire/test_private_names.py fails if ucxx moves
or renames either."""

from __future__ import annotations

from typing import Any


def thread_mode_hook() -> tuple[Any, type]:
    """ucxx's module whose ``ThreadMode`` global it instantiates, and ucxx's own
    ``ThreadMode`` class; ``ImportError`` when this ucxx no longer has them.
    ``transport`` subclasses the class; ``use_thread_mode`` writes the global."""
    # private: ucxx 0.52 has no public way to choose a progress mode's class
    from ucxx._lib_async import application_context, continuous_ucx_progress

    return application_context, continuous_ucx_progress.ThreadMode


def use_thread_mode(cls: type) -> None:
    """Make ucxx build ``cls`` (same constructor as its ``ThreadMode``) where it would
    build its ``ThreadMode``; called once per process, before ``ucxx.init``."""
    application_context, _ = thread_mode_hook()
    application_context.ThreadMode = cls


def stop_notifier() -> None:
    """Stop ucxx's notifier thread at once. ``ucxx.stop_notifier_thread`` only queues a
    stop that the thread reads after its wait for requests returns, which it does
    every second: every process that used UCX took up to 1 s to exit (a storage node
    0.6-1.1 s from SIGTERM to exit; 0.16-0.34 s with the wake). Waking the wait first
    ends it in milliseconds. The wake made ucxx log a warning ("worker progress thread
    not running or already stopped") to stdout at 1 exit in 30-40, which broke a client
    whose last stdout line is its answer (in a full run of the suite, once); with
    ``UCXX_LOG_LEVEL`` at its FATAL default (``kvstore.wire.transport.UCX_DEFAULTS``) that line is below the
    level. Measured since: 0 of 100 exits of tests/support/raw_client.py printed anything."""
    import ucxx

    ctx = ucxx.core._ctx  # private: ucxx offers no public handle on its worker
    if ctx is not None and ctx.notifier_thread is not None:
        ctx.worker.stop_request_notifier_thread()
    ucxx.stop_notifier_thread()
