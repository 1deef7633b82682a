"""Where things are: the checkout's root, which every path a test names starts from,
the folder beside the virtualenv where CI installs Triton (.ci/run), the session's
temporary folder (``use_session_tmpdir``) and the environment its engines and servers
are given (``engine_env``)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_SITE = os.environ.get("KVSTORE_TRITON_SITE", str(ROOT / ".venv" / "triton-site"))

# set by the session's first process (pytest, or its xdist controller) for its workers
SESSION_TMPDIR_VAR = "KVSTORE_TEST_TMPDIR"


def use_session_tmpdir() -> str:
    """Makes one temporary folder the ``TMPDIR`` of the whole test session: of pytest's
    process, its xdist workers (they inherit it) and every process they start, removed
    when the process that made it exits. tests/conftest.py calls it on import.

    Nodes (their same-host sockets), Valkey, ``kvstore up`` (its logs), vLLM (a
    ``vllm_dist_*`` file store per engine) and SGLang's file backend leave files in the
    temporary folder: the 2-core VM that ran the suite many times had about 1,950
    entries in /tmp. pytest's own folders (``tmp_path``) stay where they were, kept for
    the last runs."""
    mine = os.environ.get(SESSION_TMPDIR_VAR, "")
    if not os.path.isdir(mine):
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
        mine = tempfile.mkdtemp(prefix="kvstore-test-tmp-")
        os.environ[SESSION_TMPDIR_VAR] = mine
        atexit.register(shutil.rmtree, mine, True)
    os.environ["TMPDIR"] = mine
    tempfile.tempdir = mine
    return mine


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the vLLM engines, zygotes and servers a session starts
    (tests/support/engines.py, openai_server.py): this process's, with the checkout
    importable and UCX on loopback; ``extra`` on top."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo", **(extra or {})}
