"""The embedded Valkey launcher: loopback TCP, unix socket, and no leftovers after a crash."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import redis

from kvstore.errors import KVStoreError
from kvstore.tools.procutil import pid_alive
from kvstore.tools.valkey import EmbeddedValkey


def test_unix_socket_server(tmp_path):
    sock = tmp_path / "valkey.sock"
    with EmbeddedValkey(unix_socket=str(sock)) as server:
        assert server.url == f"unix://{sock}"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        pid = server.process.pid
    assert not pid_alive(pid) or open(f"/proc/{pid}/status").read().find("zombie") >= 0


@pytest.mark.process
def test_server_dies_with_a_crashed_parent_and_a_stale_pidfile_is_cleaned(tmp_path):
    pidfile = tmp_path / "valkey.pid"
    code = (
        "import sys, time\n"
        "from kvstore.tools.valkey import EmbeddedValkey\n"
        f"s = EmbeddedValkey(workdir={str(tmp_path)!r}, pidfile={str(pidfile)!r}).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert pid_alive(pid) and pidfile.read_text().strip() == str(pid)
    parent.kill()  # SIGKILL: no cleanup code runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    # the next start with the same pidfile finds the stale file and starts cleanly
    with EmbeddedValkey(workdir=str(tmp_path), pidfile=str(pidfile)) as again:
        assert redis.Redis.from_url(again.url).ping()
    assert not pidfile.exists()


def test_bound_to_loopback_only():
    with EmbeddedValkey() as server:
        config = redis.Redis.from_url(server.url).config_get("bind")
        assert config["bind"] == "127.0.0.1"


def test_a_server_that_cannot_start_says_why():
    """Valkey logs why it stops (here: its port is taken) to its log, not stderr; the
    error quotes the log, so a failed start is not an empty message."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(
            KVStoreError, match=r"exited with status \d+(.|\n)*Address already in use"
        ):
            EmbeddedValkey(taken.getsockname()[1]).start()


def test_a_picked_port_taken_before_valkey_binds_it_is_picked_again():
    """A free port can be taken between picking it and Valkey binding it (a full test
    run once lost a cluster shard so): start() picks another and the server answers."""
    server = EmbeddedValkey()
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            assert server.port != taken
            assert redis.Redis.from_url(server.url).ping()
    given = EmbeddedValkey(port=taken)  # a port the caller chose is never changed
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with pytest.raises(KVStoreError, match="Address already in use"):
            given.start()
