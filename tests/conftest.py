"""Shared fixtures: a real Valkey server per test session and per-test namespaces; and
the ``process`` marker that splits the suite into tiers.

``process`` names every test that starts a storage node, a vLLM engine or another
Python process (a worker, a ``kvstore`` command). ``pytest -m "not process" tests`` is
the fast tier (README). Tests using a fixture that starts nodes (``clusters``,
``cluster``), and every test in a ``test_vllm*`` module under tests/vllm/, are marked
here; other modules mark theirs. In a run of the fast tier an unmarked test that starts
one fails at once, naming the marker, so the tier stays what it says (Valkey servers,
``helm`` and other binaries are allowed: they start in milliseconds)."""

from __future__ import annotations

import os

# OpenMP threads that finished their share of a parallel region sleep, not spin, in
# every process the tests start (torch's libgomp reads this when it loads, so before
# any import here): two workers' engines share two cores, and each engine's threads
# spinning at barriers took the cores from the other's. Measured on the 2-core VM, two
# engine files on two workers (test_vllm_specdec, test_vllm_hybrid): 147-162 s
# spinning, 124-129 s with PASSIVE. Engines in production keep OpenMP's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile off in every process the tests start (torch reads this when
# torch._dynamo.config is imported, so before any import here, and the engine zygote
# inherits it). enforce_eager does not reach the functions vLLM compiles on their first
# call: a TP=2 engine's vocab-parallel embedding (vllm/model_executor/layers/
# vocab_parallel_embedding.py, get_masked_input_and_mask) spent 2.5-2.9 s of each run's
# first step compiling, per worker (py-spy). Its masking is integer indexing, the same
# tokens either way (checked: a TP=2 run of the tiny Llama, identical tokens, 6.6 s -> 4.0 s
# per engine). test_vllm_mla + test_vllm_mamba on two workers: 110.7 s -> 94.9 s. The
# PP=2 engines (tests/vllm/test_vllm_pp.py) need it on and say so in their environment.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import multiprocessing.process
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstore.index import PageIndex
from kvstore.pages.namespace import Namespace
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.valkey import EmbeddedValkey
from tests.support.helpers import tenant_for
from tests.support.paths import use_session_tmpdir
from tests.support.spare_index import SpareIndexes

os.environ.setdefault("UCX_NET_DEVICES", "lo")
use_session_tmpdir()  # what the session's processes write to their temporary folder goes with it
# `kvstore up` keeps its state (token, index port, pid) under XDG_STATE_HOME: the tests'
# stores keep theirs apart from the user's, so a store the user runs never refuses them
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="kvstore-test-state-")


@pytest.fixture(scope="session")
def valkey():
    with EmbeddedValkey() as server:
        yield server


@pytest.fixture()
def namespace(request) -> Namespace:
    """A namespace of small pages, unique to the test so tests never see each other's pages."""
    tenant = tenant_for(request.node.name)
    return Namespace(
        model="test-model",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        hidden_size=64,
        tenant=tenant,
    )


@pytest.fixture()
def index(valkey):
    idx = PageIndex(valkey.url)
    yield idx
    idx.close()


@pytest.fixture()
def index_shards() -> int:
    """Shards of the embedded index ``clusters`` starts (1: a single Valkey). A module
    overrides this fixture to run its tests against a Valkey cluster too."""
    return 1


@pytest.fixture(scope="session")
def spare_indexes():
    """3-shard Valkey clusters started a test ahead (tests/support/spare_index.py)."""
    spares = SpareIndexes(3)
    yield spares
    spares.close()


@pytest.fixture()
def clusters(index_shards, spare_indexes):
    """Factory of local stores (embedded Valkey + node processes), stopped after the test."""
    made: list[LocalCluster] = []

    def make(
        servers: int = 1,
        capacity: str = "256MiB",
        slab: str = "16MiB",
        extra: list[str] | None = None,
        **kw,
    ) -> LocalCluster:
        if index_shards == 3 and "redis_url" not in kw and "index" not in kw:
            kw["index"] = spare_indexes.take()
        cluster = LocalCluster(
            servers, capacity, slab_size=slab, extra_args=extra, index_shards=index_shards, **kw
        )
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()


# fixtures that start storage nodes (a test using one through another fixture counts too)
_PROCESS_FIXTURES = {"clusters", "cluster", "single_index_cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks engine and process tests, and runs the files with engines first, then the
    files with other processes, then the rest: README's whole-suite command hands
    files to two workers (pytest-xdist, ``--dist loadfile``) in this order, so the
    longest start first and the short ones fill in at the end. The whole suite on the
    2-core VM: 19:50 on one process; 14:07 on two with the files in name order (the
    engine files came last and one worker ran them alone); 13:21 in this order, for
    the suite of then. In December 2026, with 1,190 tests: 17:09 while pytest-xdist's
    own reordering undid this order (``pytest_configure``), with the engine files
    last; 15:45 with the order kept (and the SGLang checks forked, measured together),
    both workers then busy to within 2 s of each other."""
    for item in items:
        engine = item.path.parent.match("tests/vllm") and item.path.name.startswith("test_vllm")
        if engine and not item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.vllm)
        if engine or _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
    rank: dict[Path, int] = {}
    for item in items:
        mine = (
            0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("process") else 2
        )
        rank[item.path] = min(rank.get(item.path, 2), mine)
    items.sort(key=lambda item: rank[item.path])  # stable: each file's tests keep their order


def _python(args) -> bool:
    """True when ``args`` (Popen's) starts a Python interpreter or a console script."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    first = os.path.basename(os.fsdecode(argv[0]))
    return (
        first.startswith("python")
        or os.fsdecode(argv[0]) == sys.executable
        or first in ("kvstore", "vllm")
    )


_running: list[str] = []  # the test being set up, run or torn down (for the message)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[:] = [item.nodeid]


def pytest_configure(config: pytest.Config) -> None:
    """Keeps the order of ``pytest_collection_modifyitems`` under ``--dist loadfile``:
    pytest-xdist 3.6 and later hand out the files with the most tests first unless told
    not to (``loadscopereorder``), which put the engine files, a few long tests each,
    last (the whole suite 17:09 then, the last minutes on engine files).

    In a run of the fast tier (``-m "not process"``), starting a Python process fails,
    in a test or in any fixture it uses (a module's cluster too)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if "not process" not in (config.option.markexpr or ""):
        return

    def refuse(what: str):
        test = _running[0] if _running else "a test"
        raise AssertionError(
            f"{test} (or a fixture it uses) starts {what}: mark it @pytest.mark.process "
            "(the fast tier, pytest -m 'not process', leaves such tests out)"
        )

    popen_init = subprocess.Popen.__init__

    def checked_init(self, args, *a, **k):
        if _python(args):
            shown = args if isinstance(args, str) else " ".join(map(str, args))
            refuse(f"a Python process ({shown[:120]})")
        popen_init(self, args, *a, **k)

    subprocess.Popen.__init__ = checked_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = lambda self: refuse("a multiprocessing child")  # type: ignore[method-assign]
