"""Issue 27, defects 5 and 6: secrets in option errors and reprs, and ``kvstore up
--redis-url`` with an index password. Real processes: ``kvstore server``, ``kvstore
up`` with its nodes, a Valkey that requires a password."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import redis
import torch

from client import KVCacheClient
from kvstore.errors import InvalidInputError
from kvstore.index import PageIndex
from kvstore.settings.client import client_options, client_options_from_env
from kvstore.settings.config import ServerSettings
from kvstore.tools.valkey import EmbeddedValkey
from tests.support.helpers import ROOT, as_bytes, namespace_for_page_size, pages_for
from tests.support.security import cmdline

KVSTORE = [sys.executable, "-m", "kvstore.tools.cli"]
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(ROOT)}
for _name in (
    "KVSTORE_AUTH_TOKEN",
    "KVSTORE_AUTH_TOKEN_FILE",
    "KVSTORE_REDIS_PASSWORD",
    "KVSTORE_REDIS_PASSWORD_FILE",
):
    ENV.pop(_name, None)
SECRET = "hunter2-" + "s" * 16


SECRET_OPTIONS = {
    "redis_url (user-info)": {"redis_url": f"http://:{SECRET}@10.0.0.1:6379/0"},
    "redis_url (user and password)": {
        "redis_url": f"redis://admin:{SECRET}@10.0.0.1:6379/0",
        "replicas": 0,
    },
    "redis_url (query)": {"redis_url": f"redis://10.0.0.1:6379/0?password={SECRET}", "timeout": -1},
    "redis_url (wrong type)": {"redis_url": [SECRET]},
    "redis_password (wrong type)": {"redis_password": [SECRET]},
    "redis_password (bad neighbour)": {"redis_password": SECRET, "lease_ms": -5},
    "auth_token (wrong type)": {"auth_token": {"token": SECRET}},
    "auth_token (bad neighbour)": {"auth_token": SECRET, "transfer_mode": "sideways"},
    "auth_token and its file disagree": {"auth_token": SECRET, "auth_token_file": os.devnull},
}


@pytest.mark.parametrize("options", SECRET_OPTIONS.values(), ids=SECRET_OPTIONS.keys())
def test_client_option_errors_never_show_a_secret(options, monkeypatch):
    """Reproduced: "invalid client option redis_url='http://:hunter2@10.0.0.1:6379/0'",
    and a wrongly typed redis_password was echoed as given."""
    with pytest.raises(InvalidInputError) as caught:
        client_options(**options)
    assert SECRET not in str(caught.value)
    if not all(isinstance(value, (str, int)) for value in options.values()):
        return  # the environment holds strings only
    for name, value in options.items():
        monkeypatch.setenv(f"KVSTORE_{name.upper()}", str(value))
    with pytest.raises(InvalidInputError) as caught:
        client_options_from_env()
    assert SECRET not in str(caught.value)


def test_option_reprs_never_show_a_secret():
    url = f"redis://admin:{SECRET}@10.0.0.1:6379/0?password={SECRET}"
    options = client_options(redis_url=url, redis_password=SECRET, auth_token=SECRET)
    assert SECRET not in repr(options) and SECRET not in str(options)
    assert "admin:***@10.0.0.1:6379" in repr(options) and options.redis_url == url
    settings = ServerSettings(redis_url=url, redis_password=SECRET, auth_token=SECRET)
    assert SECRET not in repr(settings) and SECRET not in str(settings)


@pytest.mark.process
def test_node_option_errors_never_show_a_secret(tmp_path):
    cases = [
        ["--redis-url", f"http://:{SECRET}@10.0.0.1:6379/0", "--anonymous"],
        [
            "--redis-url",
            f"redis://10.0.0.1:6379/0?password={SECRET}",
            "--auth-token",
            SECRET,
            "--capacity",
            "1KiB",
        ],
        ["--redis-password", SECRET, "--auth-token", SECRET, "--node-ttl", "-1"],
    ]
    for args in cases:
        out = subprocess.run(
            [sys.executable, "-m", "server", *args],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and out.stderr.startswith("kvstore server: "), out.stderr[-2000:]
        assert SECRET not in out.stdout + out.stderr


# ---- 6. kvstore up with an index password -----------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("given", ["env", "file", "url"])
def test_up_takes_the_index_password_from_the_environment_a_file_or_the_url(given, tmp_path):
    """Reproduced: `kvstore up --redis-url` with KVSTORE_REDIS_PASSWORD exited 3 ("HELLO
    must be called with the client already authenticated"); only a password inside the
    URL worked, and then every node's command line showed it."""
    with EmbeddedValkey() as valkey:
        redis.Redis.from_url(valkey.url).config_set("requirepass", SECRET)
        env, url = dict(ENV), valkey.url
        if given == "env":
            env["KVSTORE_REDIS_PASSWORD"] = SECRET
        elif given == "file":
            (tmp_path / "password").write_text(SECRET + "\n")
            env["KVSTORE_REDIS_PASSWORD_FILE"] = str(tmp_path / "password")
        else:
            url = valkey.url.replace("redis://", f"redis://:{SECRET}@")
        proc = subprocess.Popen(
            [
                *KVSTORE,
                "up",
                "--redis-url",
                url,
                "--servers",
                "2",
                "--capacity",
                "64MiB",
                "--slab-size",
                "16MiB",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: list[str] = []
        try:
            deadline = time.monotonic() + 90
            while (
                not any(line.startswith("press Ctrl-C") for line in lines)
                and time.monotonic() < deadline
                and proc.poll() is None
            ):
                lines.append(proc.stdout.readline())
            assert any(line.startswith("press Ctrl-C") for line in lines), (
                proc.stderr.read() if proc.poll() is not None else lines
            )
            index = PageIndex(valkey.url, password=SECRET)
            nodes = index.live_nodes()
            assert sorted(n.node_id for n in nodes) == ["node-0", "node-1"]
            for n in nodes:
                assert SECRET not in cmdline(int(n.extra["pid"]))
            values = dict(
                line.strip().removeprefix("export ").split("=", 1)
                for line in lines
                if re.match(r"^export KVSTORE_[A-Z_]+=", line)
            )
            ns = namespace_for_page_size(64 << 10, tenant="up-password")
            tokens = list(range(4 * ns.block_size))
            with KVCacheClient(
                valkey.url,
                ns,
                redis_password=SECRET,
                auth_token_file=values["KVSTORE_AUTH_TOKEN_FILE"],
            ) as client:
                pages = pages_for(ns, tokens)
                assert client.put_pages(tokens, pages).stored == 4
                out = torch.zeros_like(pages)
                assert client.get_pages(tokens, out) == len(tokens) and torch.equal(
                    as_bytes(out), as_bytes(pages)
                )
        finally:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert SECRET not in "".join(lines) + out + err
