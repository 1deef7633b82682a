"""ucxx's progress-mode hook: the one place kvstore names ucxx's private ``_lib_async``.

ucxx builds a thread-mode progress object from the module global
``application_context.ThreadMode`` (in ``ApplicationContext.continuous_ucx_progress``),
and its public ``ucxx.init`` takes only a mode's name. So kvstore's ``loop`` mode
(``kvstore.wire.loop_progress``) and the quiet thread mode (``kvstore.wire.transport``)
each put their own class in that global, through ``use_thread_mode``, before
``ucxx.init``. tests/test_private_names.py fails if ucxx moves or renames it."""

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
