"""Worker processes of the tests: tests/support/worker.py run in a process forked from a
server that imported torch and the client once (``WorkerProcess``, ``run_worker``)."""

from __future__ import annotations

import functools
import json
import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

from tests.support.paths import ROOT


class WorkerProcess:
    """One run of tests/support/worker.py in its own process, forked from a server process that
    imported torch and the client once (multiprocessing's forkserver, see ``_workers``):
    a fresh interpreter spent about 2.6 s importing torch per worker (the whole suite:
    21.5 -> 15.6 min on the 2-core VM). The worker's stdout and stderr go to files; the methods
    are the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, spec_path: str, env: dict[str, str]) -> None:
        out = tempfile.NamedTemporaryFile(prefix="kvstore-worker-", suffix=".out", delete=False)
        err = tempfile.NamedTemporaryFile(prefix="kvstore-worker-", suffix=".err", delete=False)
        out.close(), err.close()
        self._out, self._err = Path(out.name), Path(err.name)
        # removed when the handle goes, read or not (a killed worker's never is)
        weakref.finalize(self, _remove, out.name, err.name)
        self._process = _workers().Process(
            target=_worker_main, args=(spec_path, env, out.name, err.name), daemon=True
        )
        self._process.start()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("tests/support/worker.py", timeout or 0)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return self._out.read_text(), self._err.read_text()


def _remove(*paths: str) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


@functools.cache
def _workers() -> multiprocessing.context.ForkServerContext:
    """The forkserver context whose server has imported tests.support.worker (torch, numpy, the
    client; no UCX context yet: each worker makes its own after the fork). The server
    stops when this process does."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.support.worker"])
    return ctx


def _worker_main(spec_path: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """In the forked worker: the caller's environment, stdout and stderr to files, then
    tests/support/worker.py's main with the spec file as its argument."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    from tests.support import worker

    sys.argv = [str(ROOT / "tests" / "support" / "worker.py"), "@" + spec_path]
    code = worker.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(spec: dict, timeout: float = 120, background: bool = False, env: dict | None = None):
    """Run tests/support/worker.py with ``spec`` in its own process (``WorkerProcess``), in
    ``env`` (this one's, on loopback, by default); returns its JSON result (or the
    process when ``background``)."""
    # no interpreter starts (the worker is forked), so only what the worker reads counts
    env = env or {**os.environ, "UCX_NET_DEVICES": "lo"}
    # the spec goes through a file: token lists can be long
    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", prefix="kvstore-worker-", delete=False
    ) as f:
        json.dump(spec, f)
    proc = WorkerProcess(f.name, env)
    return proc if background else worker_result(proc, timeout)


def worker_result(proc: WorkerProcess, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])
