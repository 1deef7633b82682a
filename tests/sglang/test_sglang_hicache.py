"""kvstore as SGLang's HiCache L3 backend (``client.sglang.KVStoreHiCache``), driven
by SGLang 0.5.23's own classes in a child process (tests/support/sglang_checks.py): its
backend factory loads the backend as ``--hicache-storage-backend dynamic`` does, its
host pools (MHA and MLA, every host layout served) are the memory pages land in, its
key hash names the pages, and its failure injector wraps the backend. Real storage
nodes and Valkey, but for the backend's own decisions, which run over an in-memory
store of real page bytes behind its store seam (tests/support/sglang_memory_checks.py).
SGLang's HiCache does not run on a CPU, so no SGLang server does (docs/sglang.md says
what that leaves unchecked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.engines import Finished, run_forked
from tests.support.helpers import ROOT
from tests.support.sglang_site import sglang_env, skip_without_sglang

pytestmark = [skip_without_sglang, pytest.mark.process]
CHECKS = str(ROOT / "tests" / "support" / "sglang_checks.py")
MEMORY_CHECKS = str(ROOT / "tests" / "support" / "sglang_memory_checks.py")


def run_checks(*args: str, script: str = CHECKS) -> list[dict]:
    """The JSON lines of a check: sglang_checks.py's run in a fork of a process that
    imported SGLang once for the session (tests/support/engine_zygote.py; importing
    SGLang is most of a fresh child's 8-10 s), another script in a child of its own."""
    if script == CHECKS:
        out = run_forked("sglang", list(args), sglang_env(), 240)
    else:
        done = subprocess.run(
            [sys.executable, script, *args],
            env=sglang_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        out = Finished(done.returncode, done.stdout, done.stderr)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def memory_checks() -> dict[str, dict]:
    """The checks over the memory store (no node, no index), by name, run in one child
    process: importing SGLang is most of a child's 8 s."""
    memory, config = run_checks("memory", "config", script=MEMORY_CHECKS)
    return {"memory": memory, "config": config}


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
def test_every_host_layout_round_trips_bit_exact(clusters, same_host):
    """Every served host layout, MHA and MLA, on both paths: a batch of 6 pages stored
    from SGLang's pool slots is found from its first key and from its third (SGLang asks
    from where its own cache ends) and lands bit for bit in other slots, the pages past
    it reported missing; a second store sends nothing; the copying path (no
    interface_v1) reads what v1 stored and v1 what it stored, MHA's layer_first too,
    whose flat pages hold another byte order."""
    cluster = clusters(1)
    results = run_checks("layouts", cluster.redis_url, "1" if same_host else "0")
    assert [(r["layout"], r["mla"]) for r in results] == [
        ("page_first", False),
        ("page_first_direct", False),
        ("layer_first", False),
        ("page_head", False),
        ("page_first", True),
        ("page_first_direct", True),
        ("layer_first", True),
    ]
    assert len({r["page_layout"] for r in results}) == 6  # MLA's direct and layer_first agree
    for r in results:
        assert r["stored"] == r["again"] == [True] * 6, r
        assert r["got"] == [True] * 6 + [False] * 2, r
        assert r["same"], r
        assert r["flat_set"] and r["flat_same"] == [True, True], r
        assert r["cross_same"] == [True, True] and r["back"] == [True, True] and r["back_same"], r
        assert r["exists"] == 8 and r["exists_from_2"] == 6 and r["exists_one"], r
        assert r["failures"] == {}, r


def test_the_readmes_sglang_line_builds_a_working_backend(clusters):
    """README's SGLang line, taken from README.md, parsed by SGLang's own argument
    parser and extra-config parsing: the backend it names is built by SGLang's factory
    and serves a prompt from its 70th page."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("python -m sglang.launch_server")]
    args = shlex.join(shlex.split(line)[3:])
    cluster = clusters(1)
    (out,) = run_checks("readme", cluster.redis_url, args)
    assert out == {
        "backend": "KVStoreHiCache",
        "interface_v1": 1,
        "pass_prefix_keys": False,
        "enable_hierarchical_cache": True,
        "got": True,
        "same": True,
        "failures": {},
    }


def test_prefix_keys_change_nothing(clusters):
    """SGLang's prefix keys (hicache_storage_pass_prefix_keys) are not the keys before
    a prefetch's batch in 0.5.23, so the backend places no page by them: a 300-page
    prompt backed up in batches of 128 with them is found and read bit for bit from its
    100th page on, and from any key without them."""
    cluster = clusters(1)
    (out,) = run_checks("prefix", cluster.redis_url)
    assert out == {
        "stored": True,
        "hits": [128, 72],
        "got": True,
        "same": True,
        "unplaced_from_64": 6,
        "unplaced_from_65": 5,
        "failures": {},
    }


def test_ranks_read_their_own_pages_and_others_miss(clusters):
    """TP=2 MHA ranks store and read their own heads' pages; an engine of another TP
    size, model, tenant or head size finds none of them. MLA's rank 1 stores nothing
    (its latent is rank 0's) and reads what rank 0 stored."""
    cluster = clusters(1)
    mha, mla = run_checks("ranks", cluster.redis_url)
    assert mha["set"] == mha["got"] == [[True] * 4] * 2
    assert mha["own"] == [True, True] and not mha["crossed"]
    assert mha["tp1"] == mha["other_model"] == mha["other_tenant"] == mha["other_geometry"] == 0
    assert mla["reader_set"] == [True] * 4 and mla["after_reader"] == 0
    assert mla["writer_set"] == mla["reader_got"] == [True] * 4
    assert mla["reader_has_writers"]
    # beside MLA: the window pool is rank 0's (one namespace), Mamba states each rank's
    assert mla["side_sets"] == [{"swa": [True], "mamba": [True]}] * 2
    assert mla["side_exists"] == [4, 4] and mla["side_got"] == {"swa": [True], "mamba": [True]}
    assert mla["window_is_writers"] and mla["state_is_own"]
    assert mla["writes"] == {"swa": [True, False], "mamba": [True, True]}


def test_faults_are_misses_never_exceptions(clusters):
    """SGLang's failure injector around the backend: every get is a prefix of Trues on
    bit-exact pages. With the node killed, gets and puts say False at once; with an
    index that cannot be reached, lookups say 0; each fault counted, none raised."""
    cluster = clusters(1)
    proc = subprocess.Popen(
        [sys.executable, CHECKS, "faults", cluster.redis_url],
        env=sglang_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("stored"):
            for node in cluster.nodes:
                node.kill()
            proc.stdin.write("killed\n")
            proc.stdin.flush()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    injected, dead, lost = (json.loads(x) for x in lines if x.startswith("{"))
    assert injected == {"injected_exists": [0, 8], "injected_ok": True}
    assert dead["got"] == [False] * 8 and dead["set"] == [False, False]
    assert dead["seconds"] < 10 and dead["failures"].get("set") == 1
    assert dead["failures"].get("get", 0) + dead["failures"].get("lookup", 0) >= 1
    assert lost["exists"] == 0 and lost["got"] == [False] * 2 and lost["set"] == [False] * 2
    assert lost["seconds"] < 10
    assert lost["failures"] == {"lookup": 2, "set": 1}


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
def test_a_hybrid_models_side_pools_go_through_v2(clusters, same_host):
    """A hybrid model (KV, Mamba states, sliding-window KV) as SGLang's hybrid
    controller drives it, on both data paths: each side pool's pages are a namespace of
    their own; ``batch_exists_v2`` serves the prefix lengths every pool can restore by
    its hit policy (Mamba: the page before the length holds a state; the window: its 2
    pages; all pages: every one), each pool's own boundary and every such length;
    ``batch_get_v2`` lands states and window pages bit for bit; a state under another
    prompt's key is not found."""
    cluster = clusters(1)
    (r,) = run_checks("hybrid", cluster.redis_url, "1" if same_host else "0")
    assert r["stored"] == [True] * 8 and r["sets"] == {"mamba": [True], "swa": [True, True]}
    assert r["sets2"] == {"mamba": [True]}
    assert r["mamba_and_swa"] == {"kv": 8, "pools": {"kv": 8, "mamba": 8, "swa": 8}, "ends": [8]}
    assert r["mamba"] == {"kv": 8, "pools": {"kv": 8, "mamba": 8}, "ends": [4, 8]}
    assert r["mamba_6"] == {"kv": 4, "pools": {"kv": 6, "mamba": 4}, "ends": [4]}
    assert r["swa_all"] == 0  # the window's pages only: none from the first page
    assert r["got"] == {"mamba": [True], "swa": [True, True]}
    assert r["same_state"] and r["same_swa"]
    assert r["other"] == {"mamba": [False]}
    assert r["namespaces"] == 3
    assert r["failures"] == {}, r["failures"]


def test_hybrid_lookups_answer_as_sglangs_own_file_backend(clusters):
    """SGLang's own file backend (``HiCacheFile``) as the reference for
    ``batch_exists_v2``: given the same KV, Mamba and sliding-window pages, asked the
    same random pool transfers under each hit policy, kvstore gives the same usable
    prefix, pool boundaries and restorable lengths every time (random cases with
    hits, and with holes between restorable lengths, among them)."""
    cluster = clusters(1)
    (r,) = run_checks("hybrid_vs_file", cluster.redis_url)
    assert r["asked"] == 96 and r["differ"] == 0, r["first"]
    assert r["hits"] >= 24 and r["gaps"] >= 4, r
    assert r["failures"] == {}, r["failures"]


def test_configurations_it_does_not_serve_fail_the_attach_with_one_line(memory_checks):
    """A typo, a bad tenant or option, context parallelism, no model name, an unserved
    host layout, a Mamba pool whose slots carry side states (SGLang's zero-copy path
    refuses their pages), DeepSeek V4's compressed pools and fp8 KV of an unnamed format
    each fail
    SGLang's attach naming what is wrong, instead of a cache that silently misses (or
    mixes e4m3 and e5m2 bytes: named, each is a namespace of its own). Nothing here
    reaches a node: the backends open their stores in memory."""
    out = memory_checks["config"]
    assert out["typo"].startswith("InvalidInputError: unknown key 'tennant'")
    assert "tenant='a b'" in out["bad_tenant"]
    assert "timeout=-1" in out["bad_option"]
    assert "context parallelism" in out["context_parallel"]
    assert "no model name" in out["no_model"]
    assert "host layout 'page_unified'" in out["unified"]
    assert "SGLang's mamba pool (MambaPoolHost)" in out["hybrid"] and "side states" in out["hybrid"]
    assert 'needs "kv_cache_dtype"' in out["fp8"]
    assert out["fp8_dtypes"] == ["float8_e4m3fn", "float8_e5m2"]  # two namespaces
    assert out["fp8_side_namespaces"] == 2  # a side pool's bytes are the KV's format too
    assert "deepseek_v4_c4 pool" in out["compressed"] and "block_groups" in out["compressed"]


def test_backend_decisions_over_the_memory_store(memory_checks):
    """The backend over SGLang's host pool and page keys, its store opened through its
    seam (``stores``) in memory, no node or index: a backup of 6 of 8 pages is held as
    the pool's bytes under the keyed hashes and lands bit for bit in other slots, the 2
    never stored and another prompt's pages missing, no miss counted as a fault;
    existence is asked without a read lease, a get with one. A page evicted between a
    get's lookup and its fetch is a shorter hit, counted as a get failure; an index
    that cannot answer is a miss, counted; closing the backend closes its store."""
    r = memory_checks["memory"]
    assert r["seam"] and r["stored"] == [True] * 6, r
    assert r["held"] == [True] * 6 + [False] * 2 and r["pages"] == 6
    assert r["held_bytes"] == [True] * 6
    assert (r["exists"], r["exists_unstored"], r["exists_other"]) == (6, 0, 0)
    assert r["got"] == [True] * 6 + [False] * 2 and r["same"]
    assert r["got_other"] == [False, False] and r["misses_failed"] == {}
    assert r["leases"] == [[8, False], [2, False], [4, False], [8, True], [2, True]]
    assert r["got_evicted"] == [True] * 3 + [False] * 3 and r["same_evicted"]
    assert r["evicted_failed"] == {"get": 1} and r["exists_evicted"] == 3
    assert r["down_exists"] == 0 and r["down_got"] == [False, False]
    assert r["down_failed"] == {"get": 1, "lookup": 2}
    assert r["closed"]
