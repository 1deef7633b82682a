"""The chart's KV event stream: routers and keys mounted as the node reads them, values
that cannot work refused at render time as the node would, the network policy for
routers, token ids and an open stream."""

from __future__ import annotations

import base64

import pytest
from helm_python import HelmValuesError

from kvstore.settings.config import ServerSettings
from tests.support.helm_chart import (
    mounted_file,
    pods,
    render,
    server_settings,
    storage_container,
    validate_strictly,
)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory) -> dict[str, str]:
    """Real router public keys (Z85) by name, made as `kvstore events-key router` makes them."""
    from kvstore.security.routers import new_key_files

    keys = tmp_path_factory.mktemp("curve")
    return {name: new_key_files(str(keys), name)[0] for name in ("router-a", "ops", "spare")}


def events(**kv_events) -> dict:
    return {"storage": {"kvEvents": {"enabled": True, **kv_events}}}


def routed(keys: dict[str, str], **extra) -> dict:
    """Events with two inline routers (team-a and team-b; every tenant) and the node key Secret."""
    return events(
        routers=[
            {"name": "router-a", "publicKey": keys["router-a"], "tenants": ["team-a", "team-b"]},
            {"name": "ops", "publicKey": keys["ops"], "tenants": ["*"]},
        ],
        keySecret="kvstore-events-key",
        **extra,
    )


@pytest.mark.process
def test_kv_event_routers_become_a_mounted_routers_file_the_node_accepts(
    curve_keys, monkeypatch, tmp_path
):
    from kvstore.security.routers import parse_router_keys

    objects = render(routed(curve_keys))
    secrets = {s["metadata"]["name"]: s for s in objects["Secret"]}
    text = base64.b64decode(secrets["kv-kvstore-event-routers"]["data"]["routers"]).decode()
    parsed = parse_router_keys(text, "rendered routers file")
    assert {k: (r.name, r.tenants) for k, r in parsed.items()} == {
        curve_keys["router-a"]: ("router-a", frozenset({"team-a", "team-b"})),
        curve_keys["ops"]: ("ops", None),
    }
    args = storage_container(objects)["args"]
    assert args[:2] == ["server", "--capacity"]
    routers_file = args[args.index("--kv-events-routers-file") + 1]
    key_file = args[args.index("--kv-events-key-file") + 1]
    assert (
        "--kv-events-open" not in args and "--kv-events-token-ids" not in args
    )  # default: no token ids
    # each path is a file of a mounted, read-only Secret volume
    volume, key = mounted_file(objects, routers_file)
    assert volume["secret"]["secretName"] == "kv-kvstore-event-routers" and key == "routers"
    volume, key = mounted_file(objects, key_file)
    assert volume["secret"]["secretName"] == "kvstore-events-key" and key == "node.key_secret"
    assert (
        volume["secret"]["defaultMode"] == 0o440
    )  # the pod's fsGroup reads the secret key, no one else
    # the node starts with these options, reading the rendered file and a real key
    settings = server_settings(objects, monkeypatch, tmp_path)
    assert (
        settings.kv_events_endpoint == "tcp://*:5557"
        and settings.kv_events_replay_endpoint == "tcp://*:5558"
    )
    assert (
        settings.kv_events_routers_file
        and settings.kv_events_key_file
        and not settings.kv_events_open
    )
    # the file is re-read when the Secret changes: editing routers changes the Secret, not the pods
    changed = routed(curve_keys)
    changed["storage"]["kvEvents"]["routers"][1] = {
        "name": "ops-next",
        "publicKey": curve_keys["spare"],
        "tenants": ["*"],
    }
    after = render(changed)
    assert after["StatefulSet"] == objects["StatefulSet"]
    routers = {s["metadata"]["name"]: s for s in after["Secret"]}["kv-kvstore-event-routers"][
        "data"
    ]["routers"]
    assert {r.name for r in parse_router_keys(base64.b64decode(routers).decode()).values()} == {
        "router-a",
        "ops-next",
    }
    report = validate_strictly(routed(curve_keys), tmp_path)
    assert "passed for resource secret/kv-kvstore-event-routers" in report


@pytest.mark.process
def test_kv_event_routers_from_an_existing_secret(curve_keys, monkeypatch, tmp_path):
    objects = render(
        events(
            routersExistingSecret="my-routers",
            routersKey="routers.txt",
            keySecret="kvstore-events-key",
            keySecretKey="kvstore.key_secret",
        )
    )
    assert "kv-kvstore-event-routers" not in {s["metadata"]["name"] for s in objects["Secret"]}
    args = storage_container(objects)["args"]
    volume, key = mounted_file(objects, args[args.index("--kv-events-routers-file") + 1])
    assert volume["secret"]["secretName"] == "my-routers" and key == "routers.txt"
    volume, key = mounted_file(objects, args[args.index("--kv-events-key-file") + 1])
    assert volume["secret"]["secretName"] == "kvstore-events-key" and key == "kvstore.key_secret"
    line = f"llm-d {curve_keys['spare']} team-a\n"
    settings = server_settings(
        objects, monkeypatch, tmp_path, existing={"my-routers": {"routers.txt": line}}
    )
    assert settings.kv_events_routers_file
    validate_strictly(
        events(routersExistingSecret="my-routers", keySecret="kvstore-events-key"), tmp_path
    )


def test_kv_events_without_authentication_fail_at_render_time_as_the_node_would_refuse(
    curve_keys, monkeypatch
):
    with pytest.raises(Exception, match="would refuse to start") as failure:
        render(events())
    assert "storage.kvEvents.routers" in str(failure.value) and "storage.kvEvents.open" in str(
        failure.value
    )
    assert "storage.kvEvents.keySecret" in str(failure.value) and "tcp://*:5557" in str(
        failure.value
    )
    # ... because the node refuses the same options: the ports bound, no routers file
    objects = render(events(open=True))
    args = [a for a in storage_container(objects)["args"] if a != "--kv-events-open"]
    for key, value in objects["ConfigMap"][0]["data"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", "from-the-secret")
    with pytest.raises(ValueError, match="--kv-events-routers-file"):
        ServerSettings(_cli_parse_args=args[1:])


@pytest.mark.parametrize(
    "values, message",
    [
        (
            lambda k: events(routers=[{"name": "r", "publicKey": k["ops"], "tenants": ["*"]}]),
            r"storage\.kvEvents\.keySecret is required.*kvstore events-key node",
        ),
        (
            lambda k: events(routersExistingSecret="mine"),
            r"storage\.kvEvents\.keySecret is required.*kvstore events-key node",
        ),
        (lambda k: routed(k, open=True), "open contradicts"),
        (lambda k: routed(k, routersExistingSecret="mine"), "not both"),
        (lambda k: events(open=True, keySecret="kvstore-events-key"), "keySecret goes with"),
        (lambda k: routed(k, tokenIds="team-a, team-b"), 'tokenIds: tenant " team-b" must match'),
        (lambda k: routed(k, tokenIds="*,team-a"), r"tokenIds .*stands alone"),
    ],
)
def test_kv_event_values_that_cannot_work_fail_at_render_time(curve_keys, values, message):
    with pytest.raises(Exception, match=message):
        render(values(curve_keys))


@pytest.mark.parametrize(
    "name, key, tenants, message",
    [
        ("router-a", "router-a", ["team-a", "team-b"], None),
        ("ops@monitoring.v2", "ops", ["*"], None),
        ("r_1", "spare", ["Team_A.1"], None),
        ("-router", "router-a", ["team-a"], "router name"),
        ("router a", "router-a", ["team-a"], "router name"),
        ("r" * 65, "router-a", ["team-a"], "router name"),
        ("router-a", "short", ["team-a"], "40 characters"),
        ("router-a", "~" * 40, ["team-a"], "40 characters"),  # ~ is not Z85
        ("router-a", "router-a", [], "at least one tenant"),
        ("router-a", "router-a", ["*", "team-a"], "stands alone"),
        ("router-a", "router-a", ["team a"], "must match"),
        ("router-a", "router-a", ["team:a"], "must match"),
    ],
)
def test_router_entries_are_checked_as_the_node_checks_them(
    curve_keys, name, key, tenants, message
):
    """The chart refuses a router entry exactly when kvstore/security/routers.py would."""
    from kvstore.errors import InvalidInputError
    from kvstore.security.routers import make_router_key

    public = curve_keys.get(key, key)
    values = events(
        routers=[{"name": name, "publicKey": public, "tenants": tenants}],
        keySecret="kvstore-events-key",
    )
    if message is None:
        render(values)
        make_router_key(name, public, tenants)
        return
    with pytest.raises(Exception, match=message):
        render(values)
    with pytest.raises(InvalidInputError):
        make_router_key(name, public, tenants)


def test_router_names_and_keys_are_listed_once(curve_keys):
    twice = routed(curve_keys)
    twice["storage"]["kvEvents"]["routers"].append(
        {"name": "ops", "publicKey": curve_keys["spare"], "tenants": ["team-c"]}
    )
    with pytest.raises(Exception, match="router ops is listed twice"):
        render(twice)
    same_key = routed(curve_keys)
    same_key["storage"]["kvEvents"]["routers"].append(
        {"name": "ops-2", "publicKey": curve_keys["ops"], "tenants": ["team-c"]}
    )
    with pytest.raises(Exception, match="the key of ops-2 is already listed as ops"):
        render(same_key)
    with pytest.raises(HelmValuesError, match="publicKey"):  # the schema wants each field
        render(events(routers=[{"name": "r", "tenants": ["*"]}], keySecret="k"))


def ingress_ports(policy: dict) -> list[tuple[list, list[str]]]:
    return [
        (rule.get("from", []), [p["port"] for p in rule["ports"]])
        for rule in policy["spec"]["ingress"]
    ]


def test_network_policy_lets_routers_reach_the_event_ports_when_events_are_on(curve_keys):
    selectors = {
        "routerPodSelector": {"matchLabels": {"app": "llm-d-router"}},
        "routerNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-d"}},
    }
    values = routed(curve_keys)
    values["storage"]["networkPolicy"] = {"enabled": True, **selectors}
    objects = render(values)
    (policy,) = objects["NetworkPolicy"]
    rules = ingress_ports(policy)
    router_from = [
        {
            "podSelector": selectors["routerPodSelector"],
            "namespaceSelector": selectors["routerNamespaceSelector"],
        }
    ]
    assert (router_from, ["kv-events", "kv-replay"]) in rules
    assert all(
        "kv-events" not in ports for source, ports in rules if source != router_from
    )  # only routers reach events
    assert [ports for source, ports in rules if source == router_from] == [
        ["kv-events", "kv-replay"]
    ]  # and only events
    named = {p["name"] for p in storage_container(objects)["ports"]}
    assert {
        port for _, ports in rules for port in ports
    } <= named  # every policy port names a container port
    # no replay socket: only the PUB port
    values["storage"]["kvEvents"]["replayPort"] = 0
    assert (router_from, ["kv-events"]) in ingress_ports(render(values)["NetworkPolicy"][0])
    # events off: the selectors open nothing
    off = {"storage": {"networkPolicy": {"enabled": True, **selectors}}}
    rules = ingress_ports(render(off)["NetworkPolicy"][0])
    assert [ports for _, ports in rules] == [["ucx"], ["metrics"]]


@pytest.mark.parametrize(
    "tokens, wanted",
    [("", frozenset()), ("team-a,team-b", frozenset({"team-a", "team-b"})), ("*", None)],
)
def test_token_ids_render_their_flag(curve_keys, monkeypatch, tmp_path, tokens, wanted):
    from kvstore.settings.events import token_tenants

    objects = render(routed(curve_keys, tokenIds=tokens))
    args = storage_container(objects)["args"]
    assert ("--kv-events-token-ids" in args) == bool(tokens)
    if tokens:
        assert args[args.index("--kv-events-token-ids") + 1] == tokens
    settings = server_settings(objects, monkeypatch, tmp_path)
    assert token_tenants(settings, checks_tokens=True) == wanted


def test_an_open_stream_renders_its_flag_and_no_keys(monkeypatch, tmp_path):
    objects = render(events(open=True, tokenIds="team-a"))
    args = storage_container(objects)["args"]
    assert (
        "--kv-events-open" in args
        and "--kv-events-routers-file" not in args
        and "--kv-events-key-file" not in args
    )
    assert args[args.index("--kv-events-token-ids") + 1] == "team-a"
    assert "kv-kvstore-event-routers" not in {s["metadata"]["name"] for s in objects["Secret"]}
    assert [v["name"] for v in pods(objects)["storage"]["volumes"]] == ["tmp", "credentials"]
    settings = server_settings(objects, monkeypatch, tmp_path)
    assert settings.kv_events_open and not settings.kv_events_routers_file
    assert "anyone who reaches these ports" in objects["NOTES"][0]
    # events off: none of the event flags, volumes or Secrets, whatever else is set
    plain = render({"storage": {"kvEvents": {"open": True, "tokenIds": "*"}}})
    assert storage_container(plain)["args"] == [
        "server",
        "--capacity",
        storage_container(plain)["args"][2],
    ]


@pytest.mark.parametrize("profile", ["vllm", "dynamo"])
def test_the_event_profile_reaches_the_node(curve_keys, monkeypatch, tmp_path, profile):
    objects = render(routed(curve_keys, profile=profile))
    assert server_settings(objects, monkeypatch, tmp_path).kv_events_profile == profile


def test_an_unknown_event_profile_fails_at_render_time(curve_keys):
    with pytest.raises(HelmValuesError, match="profile"):
        render(routed(curve_keys, profile="llm-d"))
