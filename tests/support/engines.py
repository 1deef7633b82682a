"""Runs ``tests/support/vllm_engine.py`` (a real vLLM engine, or a tiny model's writer) in a
process of its own, for every engine test: ``run_engine`` and ``write_model``.

Each run is a fresh process forked from an engine zygote (``tests/support/engine_zygote.py``)
that imported vLLM once for the whole session, which saves about half of each engine's
10 s on the CI machine. ``fresh=True`` (or ``KVSTORE_TEST_FRESH_ENGINES=1`` for every
run) starts a new interpreter instead, as a user's ``python`` would: the tests that
check what two separately started engines agree on use it once."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.helpers import ROOT
from tests.support.paths import engine_env
from tests.support.sglang_site import sglang_env

SCRIPT = ROOT / "tests" / "support" / "vllm_engine.py"
ENGINE_TIMEOUT_S = 300
# after an engine reported its status, how long its workers get to exit (the connection
# closes when they have)
EXIT_GRACE_S = 30


@dataclass
class Finished:
    """A finished run: its exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


class _Zygote:
    """One of the session's zygotes (``kind``: "engine", or "sglang" for the SGLang
    checks, in ``env``), started on first use and stopped when pytest exits (its standard
    input closes then too, if pytest dies)."""

    def __init__(self, kind: str, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvstore-zygote-")
        self.socket_path = os.path.join(self._dir, "zygote.sock")
        self._proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "support" / "engine_zygote.py"),
                self.socket_path,
                kind,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(ROOT),
        )
        assert self._proc.stdout is not None
        said = []
        for line in self._proc.stdout:  # whatever the imports print comes first
            if line.strip() == b"ready":
                break
            said.append(line)
        else:
            self._proc.kill()
            raise RuntimeError(
                f"the engine zygote did not start (it said {b''.join(said)[-2000:]!r})"
            )
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> Finished:
        with tempfile.TemporaryDirectory(prefix="kvstore-engine-") as out:
            paths = {"stdout": os.path.join(out, "stdout"), "stderr": os.path.join(out, "stderr")}
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), **paths}
            status = self._ask(request, timeout)
            stdout, stderr = (Path(paths[k]).read_text(errors="replace") for k in paths)
        if status is None:
            return Finished(-signal.SIGKILL, stdout, stderr + "\n[engine died or timed out]")
        return Finished(status, stdout, stderr)

    def _ask(self, request: dict, timeout: float) -> int | None:
        """The child's exit status, or None when it died or ran past ``timeout``
        (then its process group is killed)."""
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            received = b""
            pid = status = None
            while True:
                left = deadline - time.monotonic()
                if status is not None:
                    left = min(left, EXIT_GRACE_S)
                if left <= 0:
                    break
                conn.settimeout(left)
                try:
                    chunk = conn.recv(4096)
                except TimeoutError:
                    break
                if not chunk:
                    return status
                received += chunk
                lines = received.split(b"\n")[:-1]
                if lines:
                    pid = int(lines[0])
                if len(lines) > 1:
                    status = int(lines[1])
            if status is None and pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return status


_zygotes: dict[str, _Zygote] = {}


def _zygote_env(kind: str) -> dict[str, str]:
    """The environment a zygote starts in (each child's is its request's)."""
    if kind == "sglang":
        return sglang_env()
    return engine_env()


def run_forked(kind: str, argv: list[str], env: dict[str, str], timeout: float) -> Finished:
    """``argv`` run in a fork of the session's ``kind`` zygote ("engine":
    ``tests/support/vllm_engine.py``'s arguments; "sglang": ``sglang_checks.py``'s), with
    ``env`` as its environment."""
    if kind not in _zygotes:
        _zygotes[kind] = _Zygote(kind, _zygote_env(kind))
    return _zygotes[kind].run(argv, env, timeout)


def _run(argv: list[str], env: dict[str, str] | None, timeout: float, fresh: bool) -> Finished:
    env = engine_env(env)
    if fresh or os.environ.get("KVSTORE_TEST_FRESH_ENGINES") == "1":
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Finished(proc.returncode, proc.stdout, proc.stderr)
    return run_forked("engine", argv, env, timeout)


def run_engine(
    spec: dict,
    env: dict[str, str] | None = None,
    *,
    fresh: bool = False,
    timeout: float = ENGINE_TIMEOUT_S,
) -> dict:
    """One engine (``tests/support/vllm_engine.py``'s ``spec``) in its own process: its JSON
    answer, plus ``stderr`` and ``log`` (both streams: vLLM's handlers, which the
    connector's loggers use, write to standard output). Fails the test on a non-zero
    exit, showing the end of its standard error."""
    done = _run([json.dumps(spec)], env, timeout, fresh)
    assert done.returncode == 0, done.stderr[-4000:]
    # raw_decode: a worker process's log line may run on after the answer's line (TP=2)
    line = [line for line in done.stdout.splitlines() if line.startswith('{"results"')][-1]
    return {
        **json.JSONDecoder().raw_decode(line)[0],
        "stderr": done.stderr,
        "log": done.stdout + done.stderr,
    }


def write_model(command: str, path: str | Path, *args: str) -> str:
    """Writes a tiny model (``command``: ``write-model``, ``write-mla-model``, ...; see
    tests/support/vllm_engine.py) to ``path``; returns the path."""
    done = _run([command, str(path), *args], None, ENGINE_TIMEOUT_S, fresh=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return str(path)
