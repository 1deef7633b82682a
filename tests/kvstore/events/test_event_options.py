"""The event stream's rules and options: which topics a subscription becomes,
routers-file lines refused or read as written, event options that cannot work (a node
checking tokens refuses a stream open to the network, naming the ways out), and who
gets token ids by default."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvstore.events import tenant_prefix
from kvstore.events.access import CurveKeys, EventAccess
from kvstore.security.routers import load_key_pair, new_key_files, parse_router_keys, router_keys
from kvstore.tools.procutil import free_port
from tests.support.helpers import KVSTORE_CLI as KVSTORE
from tests.support.helpers import cli_env
from tests.support.security import tenant_credentials

ENV = cli_env()  # no token: each test hands its processes the one it means


@pytest.mark.parametrize(
    ("tenants", "asked", "granted"),
    [
        ("*", b"", [b""]),
        ("*", b"kv@pool:s:team-a@", [b"kv@pool:s:team-a@"]),
        ("team-a", b"", [b"kv@pool:s:team-a@"]),
        ("team-a", b"kv@", [b"kv@pool:s:team-a@"]),
        ("team-a", b"kv@pool:s:team-a@model-x", [b"kv@pool:s:team-a@model-x"]),
        ("team-a", b"kv@pool:s:team-b@", []),
        ("team-a", b"kv@pool:s:team-ab@", []),  # a longer tenant name is another tenant
        ("team-a", b"kv@pool:s@digest", []),  # a topic of no tenant
        ("team-a,team-b", b"kv@pool:s:", [b"kv@pool:s:team-a@", b"kv@pool:s:team-b@"]),
    ],
)
def test_a_subscription_becomes_the_topics_the_router_both_asked_for_and_may_read(
    tmp_path, tenants, asked, granted
):
    """``EventAccess.grants``: the intersection of the prefix asked for and each tenant's
    prefix, so a router reads exactly the topics it asked for among those it may read."""
    public, secret_file = new_key_files(str(tmp_path), "r")
    routers = tmp_path / "routers"
    routers.write_text(f"# a comment\nr {public} {tenants}\n")
    node_public, node_secret = load_key_pair(secret_file, "k")
    access = EventAccess(
        CurveKeys(node_public, node_secret),
        router_keys(str(routers)),
        lambda t: tenant_prefix("s", t),
    )
    assert access.grants(public, asked) == granted
    assert access.grants("x" * 40, asked) == []  # an unknown key gets nothing
    for prefix in granted:
        assert access.reads(public, prefix + b"model")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("r1 short team-a", "40 characters of Z85"),
        ("r1 " + "a" * 40, "expected 'name public-key tenants'"),
        ("r1 " + "a" * 40 + " bad/tenant", "tenant"),
        ("r1 " + "a" * 40 + " *,team-a", "* stands alone"),
        ("r1 " + "a" * 40 + " team-a\nr2 " + "a" * 40 + " team-b", "already listed as r1"),
        ("r1 " + "a" * 40 + " team-a\nr1 " + "b" * 40 + " team-b", "listed twice"),
    ],
)
def test_a_bad_routers_file_line_is_refused_naming_it(line, problem):
    with pytest.raises(ValueError, match="routers line"):
        parse_router_keys(line, "routers")
    with pytest.raises(ValueError, match=problem.replace("*", r"\*")):
        parse_router_keys(line, "routers")


def test_a_z85_key_holding_a_hash_sign_is_not_a_comment():
    key = "#" + "a" * 39
    assert parse_router_keys(f"# routers\nr1 {key} team-a\n")[key].tenants == frozenset({"team-a"})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (
            {"kv_events_endpoint": "tcp://*:5557", "kv_events_key_file": "node.key_secret"},
            "--kv-events-routers-file and --kv-events-key-file go together",
        ),
        (
            {
                "kv_events_endpoint": "tcp://router:5557",
                "kv_events_routers_file": "r",
                "kv_events_key_file": "k",
            },
            "connects to a router",
        ),
        ({"kv_events_routers_file": "r", "kv_events_key_file": "k"}, "needs --kv-events-endpoint"),
        (
            {"kv_events_endpoint": "tcp://*:5557", "kv_events_token_ids": "team-a,*"},
            "* stands alone",
        ),
        ({"kv_events_endpoint": "tcp://*:5557", "auth_token": "t"}, "--kv-events-open"),
        (
            {
                "kv_events_endpoint": "tcp://127.0.0.1:5557",
                "kv_events_replay_endpoint": "tcp://*:5558",
                "auth_token": "t",
            },
            "tcp://*:5558",
        ),
    ],
)
def test_event_options_that_cannot_work_are_refused_naming_them(options, named):
    """Inconsistent event options, and a token-checking node's open stream beyond
    loopback, stop the node before it starts, naming what to change."""
    from pydantic import ValidationError

    from kvstore.settings.config import ServerSettings

    base = {"redis_url": "redis://127.0.0.1:1/0", "anonymous": True}
    with pytest.raises(ValidationError, match=re.escape(named)):
        ServerSettings(**{**base, **options})


def test_token_ids_default_to_every_tenant_only_on_an_anonymous_node():
    from kvstore.settings.events import EventSettings, token_tenants

    assert token_tenants(EventSettings(), checks_tokens=False) is None
    assert token_tenants(EventSettings(), checks_tokens=True) == frozenset()
    assert token_tenants(EventSettings(kv_events_token_ids=""), checks_tokens=False) == frozenset()
    assert token_tenants(EventSettings(kv_events_token_ids="a,b"), checks_tokens=True) == {"a", "b"}


@pytest.mark.process
def test_a_node_checking_tokens_will_not_publish_to_anyone_on_the_network(tmp_path):
    """A node with tenants' credentials refuses to start with events bound to every
    interface and no routers file (the finding: anyone reaching the port read every
    tenant's token ids); it names the ways out. ``kvstore up`` refuses a non-loopback
    event address the same way."""
    creds, _ = tenant_credentials(tmp_path)
    port = free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--credentials-file",
            str(creds),
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--kv-events-endpoint",
            f"tcp://*:{port}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    for option in ("--kv-events-routers-file", "--kv-events-open", "loopback"):
        assert option in out.stderr
    out = subprocess.run(
        [*KVSTORE, "up", "--kv-events-endpoint", f"tcp://*:{port}"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "loopback" in out.stderr
    # a routers file that does not load stops the node, naming the file and the line
    bad = tmp_path / "routers"
    bad.write_text("router-x not-a-key team-a\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--anonymous",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--kv-events-endpoint",
            f"tcp://*:{port}",
            "--kv-events-routers-file",
            str(bad),
            "--kv-events-key-file",
            str(bad),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and f"{bad} line 1" in out.stderr and "Z85" in out.stderr
