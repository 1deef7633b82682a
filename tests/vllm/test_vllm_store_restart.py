"""`kvstore up` restarted under a running engine (the connector in this process,
tests/support/connector_harness.py): the restart on the same state directory comes back at the
same index URL with the same token file, `kvstore down` stops it, and the engine's saves
and loads resume without a restart of its own."""

from __future__ import annotations

import subprocess
import time

import pytest

pytest.importorskip("vllm")

from kvstore.index import PageIndex
from tests.support.connector_harness import (
    BLOCK,
    PROMPT_A,
    PROMPT_C,
    ConnectorHarness,
    write_config,
)
from tests.support.helpers import KVSTORE_CLI, cli_env, wait_for


def up(state_dir: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """`kvstore up` on ``state_dir``, and the variables of the export lines it printed."""
    proc = subprocess.Popen(
        [
            *KVSTORE_CLI,
            "up",
            "--capacity",
            "64MiB",
            "--slab-size",
            "16MiB",
            "--state-dir",
            state_dir,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while not any(line.startswith("press Ctrl-C") for line in lines):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
    assert any("kvstore down" in line for line in lines), "".join(lines)
    return proc, dict(
        line.strip().removeprefix("export ").split("=", 1)
        for line in lines
        if line.startswith("export ")
    )


def down(state_dir: str) -> str:
    out = subprocess.run(
        [*KVSTORE_CLI, "down", "--state-dir", state_dir],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def stored(url: str) -> int:
    return sum(s.pages for s in PageIndex(url).stats().namespaces)


def test_a_restarted_store_serves_the_same_engine_again(tmp_path):
    state = str(tmp_path / "state")
    model = write_config(tmp_path / "model")
    first, exports = up(state)
    url, token = exports["KVSTORE_REDIS_URL"], exports["KVSTORE_AUTH_TOKEN_FILE"]
    extra = {"auth_token_file": token}
    try:
        with ConnectorHarness(model, url, extra=extra) as engine:
            engine.generate({"a": PROMPT_A}, max_tokens=2)
            wait_for(lambda: stored(url) == 6, 10, "A's pages")
            assert "stopped kvstore up" in down(state)
            assert first.wait(30) == 0
            assert "no kvstore up runs" in down(state)  # stopping none is not an error
            second, again = up(state)
            try:
                assert again == exports  # the same index URL and token file
                engine.generate({"c": PROMPT_C}, max_tokens=2)  # a save after the restart
                wait_for(lambda: stored(url) == 7, 20, "C's pages in the restarted store")
                engine.generate({"c2": PROMPT_C}, max_tokens=2)  # and a load
                metrics = engine.metrics()
                assert engine.finished["c2"].num_cached_tokens == 7 * BLOCK, metrics
                assert engine.finished["c2"].tokens == engine.finished["c"].tokens
            finally:
                down(state)
                second.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
