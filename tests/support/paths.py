"""Where things are: the checkout's root, which every path a test names starts from,
the folder beside the virtualenv where CI installs Triton (.ci/run), and the temporary
folder and environment the session's engines and servers are given (``engine_env``)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_SITE = os.environ.get("KVSTORE_TRITON_SITE", str(ROOT / ".venv" / "triton-site"))

_engine_tmp: list[str] = []


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the vLLM engines, zygotes and servers a session starts
    (tests/support/engines.py, openai_server.py): this process's, with the checkout
    importable, UCX on loopback and ``engine_tmpdir`` as ``TMPDIR``; ``extra`` on top."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "UCX_NET_DEVICES": "lo",
        "TMPDIR": engine_tmpdir(),
        **(extra or {}),
    }


def engine_tmpdir() -> str:
    """The ``TMPDIR`` of the vLLM engines and servers a session starts, removed when the
    session's process exits: every vLLM engine writes a ``vllm_dist_*`` file store into its temporary
    folder and never removes it (hundreds were left in /tmp by a few runs of the suite)."""
    if not _engine_tmp:
        _engine_tmp.append(tempfile.mkdtemp(prefix="kvstore-engine-tmp-"))
        atexit.register(shutil.rmtree, _engine_tmp[0], True)
    return _engine_tmp[0]
