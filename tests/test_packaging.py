"""What a wheel ships (the Dockerfile installs one): every folder of Python code under
kvstore/, server/ and client/ is a package pyproject.toml lists, so an installed node
or client never lacks a module that the editable checkout has."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
