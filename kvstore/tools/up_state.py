"""What ``kvstore up`` keeps across restarts, in a directory only its user can read
(``UpState``): the data-plane token it made, the embedded index's port, the pid of
the ``kvstore up`` running on it (what ``kvstore down`` stops), and what its node
supervisor saw (``supervision``: which node died how often and why, read by
``kvstore stats`` and ``kvstore down``).

Engines are configured once with what ``up`` printed (``KVSTORE_REDIS_URL``,
``KVSTORE_AUTH_TOKEN_FILE``): a restarted store on the same state directory comes back
at the same index URL with the same token, so they recover without a restart of their
own. The token file is never deleted (engines read it); ``kvstore up --state-dir``
picks another directory, and deleting one forgets its store's token."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidInputError
from kvstore.security.credentials import new_token
from kvstore.tools.cli_access import write_secret
from kvstore.tools.procutil import pid_alive


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/kvstore/up`` (``~/.local/state/kvstore/up`` without it)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "kvstore" / "up"


class UpState:
    """One state directory. ``claim`` before starting a store on it, ``release`` after."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path else default_state_dir()
        self._pid_file = self.path / "pid"

    def claim(self) -> None:
        """Make the directory (mode 0700) and record this process as its store; refuse
        when another ``kvstore up`` runs on it."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        other = self.running_pid()
        if other is not None and other != os.getpid():
            raise InvalidInputError(
                f"a kvstore up (pid {other}) already runs with state directory {self.path}: "
                "stop it with `kvstore down`, or give this one another --state-dir"
            )
        self._pid_file.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        """Forget this process as the directory's store (the token and port stay)."""
        if self.running_pid() == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                self._pid_file.unlink()

    def running_pid(self) -> int | None:
        """The pid of the ``kvstore up`` running on this directory, None when none is."""
        try:
            pid = int(self._pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        proc = Path(f"/proc/{pid}")
        with contextlib.suppress(OSError):
            if b"kvstore" not in (proc / "cmdline").read_bytes():
                return None  # the pid was reused by another program
            if "\nState:\tZ" in (proc / "status").read_text():
                return None  # exited, not yet reaped by its parent
        return pid

    def token_file(self) -> str:
        """The data-plane token's file, made (0600) the first time."""
        path = self.path / "auth-token"
        if not path.exists():
            write_secret(str(path), new_token())
        return str(path)

    def index_port(self) -> int | None:
        """The embedded index's port of the last start, when it is free to bind again."""
        try:
            port = int((self.path / "index-port").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        with socket.socket() as probe:
            # as Valkey binds: a port whose last connections are in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return None
        return port

    def keep_index_port(self, port: int) -> None:
        (self.path / "index-port").write_text(f"{port}\n")

    def write_supervision(self, doc: dict[str, Any]) -> None:
        """Keep the supervisor's document (``kvstore.tools.supervise``), stamped with this
        process's pid; replaced whole (rename), so a reader never sees half of one."""
        path = self.path / "supervision.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**doc, "pid": os.getpid()}, indent=1))
        os.replace(tmp, path)

    def supervision(self, pid: int | None = None) -> dict[str, Any] | None:
        """The supervisor's document of the ``kvstore up`` with ``pid`` (by default the
        one running now; None when none runs, or its file is missing or another's).
        It outlives that ``up``: ``kvstore down`` reads it after the stop."""
        pid = self.running_pid() if pid is None else pid
        if pid is None:
            return None
        try:
            doc = json.loads((self.path / "supervision.json").read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("pid") == pid else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """``kvstore down``: SIGTERM the store running on this directory and wait until
        it exited; its pid, or None when none ran. Raises ``TimeoutError`` when it is
        still running after ``timeout`` seconds."""
        pid = self.running_pid()
        if pid is None:
            return None
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.running_pid() == pid:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"kvstore up (pid {pid}) still runs {timeout:.0f} s after SIGTERM"
                )
            time.sleep(0.1)
        return pid
