"""What a wheel ships (the Dockerfile installs one): every folder of Python code under
kvstore/, server/ and client/ is a package pyproject.toml lists, so an installed node
or client never lacks a module that the editable checkout has."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.support.paths import ROOT


def test_every_code_folder_is_a_listed_package_with_an_init():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for top in ("kvstore", "server", "client")
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert folders - listed == set(), "folders of code a wheel would leave out"
    assert listed - folders == set(), "listed packages with no code"
    missing_init = {
        name for name in folders if not (ROOT / name.replace(".", "/") / "__init__.py").exists()
    }
    assert missing_init == set(), (
        "namespace folders (setuptools would not treat them as listed packages)"
    )


def test_data_files_the_code_reads_are_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]
    assert "lua/*.lua" in data["kvstore.index"]  # the index scripts
    assert list((ROOT / "kvstore/index/lua").glob("*.lua"))


def test_the_programs_kvstore_starts_are_modules_of_this_project():
    """kvstore starts the floors above by module name (kvstore.tools.programs): each
    name must still be a runnable module here, or ``kvstore up`` and the demo break."""
    import importlib.util
    import sys

    from kvstore.tools.programs import DEMO_WORKER, STORAGE_NODE

    for program in (STORAGE_NODE, DEMO_WORKER):
        spec = importlib.util.find_spec(program.module)
        assert spec is not None and spec.origin is not None, program
        runnable = spec.submodule_search_locations is None or importlib.util.find_spec(
            program.module + ".__main__"
        )
        assert runnable, f"{program.module} has no __main__"
        assert program.argv("--x") == [sys.executable, "-m", program.module, "--x"]


def _name(requirement: str) -> str:
    """A requirement's project name, normalised as pip does ("redis[hiredis]>=5" -> redis)."""
    bare = re.split(r"[\[<>=!~; ]", requirement.strip('"'), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", bare).lower()


def _constrained(path: Path) -> dict[str, str]:
    """Name (normalised as pip does) -> pinned version of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not an exact pin"
            pins[_name(name)] = version
    return pins


def test_every_dependency_is_pinned_by_the_constraints_the_installs_use():
    """A new release cannot change what a fresh install gets (redis-py 8.2.0 turned CI red
    overnight): every dependency of the package, its dev and vllm extras, is pinned in
    constraints.txt, and README's install lines and .ci/run all pass it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = config["dependencies"] + [
        d for extra in ("dev", "vllm") for d in config["optional-dependencies"][extra]
    ]
    pins = _constrained(ROOT / "constraints.txt")
    names = {_name(d) for d in wanted}
    assert names - set(pins) == set(), "not pinned in constraints.txt"
    assert pins["torch"] == "2.13.0" and "+" not in pins["torch"]
    readme = (ROOT / "README.md").read_text()
    installs = [line for line in readme.splitlines() if "/pip install" in line and "-e" in line]
    assert len(installs) >= 2 and all("-c constraints.txt" in line for line in installs)
    ci = (ROOT / ".ci" / "run").read_text()
    ci_installs = [line for line in ci.splitlines() if re.match(r"\.venv\S*/bin/pip install", line)]
    assert ci_installs and all(
        "-c constraints.txt" in line
        or "-c .ci/constraints-dynamo.txt" in line
        or "--no-deps" in line
        for line in ci_installs
    ), ci_installs
    assert _constrained(ROOT / ".ci" / "constraints-dynamo.txt")["ai-dynamo-runtime"] == "1.6.1"


def test_the_node_image_installs_every_dependency_but_torch_from_the_constraints():
    """The image installs the kvstore wheel without its dependencies (torch is the
    client's, and gigabytes), so its own pip line must name the rest: it lacked pyzmq,
    msgspec, pysimdjson and pybase64, which the node imports."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {_name(d) for d in config["dependencies"]}
    docker = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [
        ln
        for ln in docker.splitlines()
        if "pip install --no-cache-dir -c /wheels/constraints.txt" in ln
    ]
    named = line.split("-c /wheels/constraints.txt", 1)[1].split("&&", 1)[0].split()
    named = {_name(n) for n in named}
    assert needed - named == {"torch"}, needed - named
