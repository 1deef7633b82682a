"""The chart's Valkey and its ACL users with real processes: the entrypoint keeps the
password out of argv, and the rendered users and tenant credentials work against a
real index and node."""

from __future__ import annotations

import base64
import os
import subprocess

import pytest
import yaml
from redis import exceptions as redis_errors

from tests.support.helm_chart import CHART, load_values, pods, render, storage_container
from tests.support.helpers import wait_for


def test_valkey_starts_through_its_entrypoint_and_keeps_its_password_out_of_argv(tmp_path):
    import redis

    from kvstore.tools.procutil import free_port
    from kvstore.tools.valkey import valkey_binary

    objects = render({"index": {"password": "pw-in-secret"}})
    pod = pods(objects)["valkey"]
    valkey = pod["containers"][0]
    assert "command" not in valkey and valkey["args"][:2] == ["valkey-server", "/conf/auth.conf"]
    assert "requirepass" not in yaml.safe_dump(valkey["args"])
    assert "valkey-cli" in valkey["readinessProbe"]["exec"]["command"][-1]
    # the init container's script, run for real with an awkward password: the written
    # config file makes a real valkey-server require exactly that password
    script = pod["initContainers"][0]["command"][-1].replace("/conf/", f"{tmp_path}/")
    password = 'p"a\\ss w$rd'
    subprocess.run(
        ["sh", "-c", script],
        env={"VALKEY_PASSWORD": password, "PATH": os.environ["PATH"]},
        check=True,
    )
    port = free_port()
    server = subprocess.Popen(
        [
            valkey_binary(),
            str(tmp_path / "auth.conf"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=5)
        wait_for(lambda: ping(client), 5, "valkey-server to start")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, protocol=2).ping()  # NOAUTH without the password
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.process
def test_chart_index_users_and_tenant_credentials_work_with_real_processes(tmp_path):
    """With tenants: the init container's script (run for real) writes one index user per
    role with exactly the rules of `kvstore acl`, and a real valkey-server loads them; a
    storage node with the rendered node user and credentials Secret, and clients with a
    tenant's Secret, store and read pages; a read-only tenant cannot write, a tenant's
    index user sees no other tenant's entries and cannot register a node."""
    import redis
    import torch

    from client import KVCacheClient
    from kvstore.index import PageIndex
    from kvstore.security import acl
    from kvstore.tools.launcher import LocalCluster
    from kvstore.tools.procutil import free_port
    from kvstore.tools.valkey import valkey_binary
    from tests.support.helpers import namespace_for_page_size, pages_for

    objects = render(load_values(CHART / "ci" / "tenants-values.yaml"))
    secrets = {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for s in objects["Secret"]
    }
    init = pods(objects)["valkey"]["initContainers"][0]
    env = {"PATH": os.environ["PATH"]}
    for var in init["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = secrets[ref["name"]][ref["key"]]
    subprocess.run(
        ["sh", "-c", init["command"][-1].replace("/conf/", f"{tmp_path}/")], env=env, check=True
    )
    conf = (tmp_path / "auth.conf").read_text().splitlines()
    for user, role, tenant in (
        ("node", "node", None),
        ("operator", "operator", None),
        ("team-a", "client", "team-a"),
        ("dashboards", "client", "dashboards"),
    ):
        line = next(entry for entry in conf if entry.startswith(f"user kvstore-{user} "))
        assert line.split(" ", 4)[4] == acl.rules(role, tenant)
    storage_env = {e["name"]: e for e in storage_container(objects)["env"]}
    assert (
        storage_env["KVSTORE_REDIS_URL"]["value"] == "redis://kvstore-node@kv-kvstore-valkey:6379/0"
    )
    credentials = tmp_path / "credentials"
    credentials.write_text(secrets["kv-kvstore-credentials"]["credentials"])
    assert storage_env["KVSTORE_CREDENTIALS_FILE"]["value"].endswith("/credentials")

    port = free_port()
    server = subprocess.Popen(
        [
            valkey_binary(),
            str(tmp_path / "auth.conf"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:

        def url(user: str, password: str) -> str:
            return f"redis://{user}:{password}@127.0.0.1:{port}/0"

        team_a, dashboards = (
            secrets["kv-kvstore-tenant-team-a"],
            secrets["kv-kvstore-tenant-dashboards"],
        )
        wait_for(
            lambda: ping(
                redis.Redis.from_url(url(team_a["redis-username"], team_a["redis-password"]))
            ),
            5,
            "valkey-server to start",
        )
        for name, secret in (("team-a", team_a), ("dashboards", dashboards)):
            (tmp_path / f"{name}.token").write_text(secret["auth-token"])
        node_url = url("kvstore-node", secrets["kv-kvstore-index-users"]["node-password"])
        with LocalCluster(
            servers=1,
            capacity="64MiB",
            slab_size="16MiB",
            redis_url=node_url,
            env={"KVSTORE_CREDENTIALS_FILE": str(credentials)},
        ):
            ns_a, ns_d = (
                namespace_for_page_size(64 << 10, tenant="team-a"),
                namespace_for_page_size(64 << 10, tenant="dashboards"),
            )
            tokens = list(range(4 * ns_a.block_size))
            with KVCacheClient(
                url(team_a["redis-username"], team_a["redis-password"]),
                ns_a,
                auth_token_file=str(tmp_path / "team-a.token"),
            ) as a:
                assert a.put_pages(tokens, pages_for(ns_a, tokens)).stored == 4
                out = torch.zeros_like(pages_for(ns_a, tokens))
                assert a.get_pages(tokens, out) == len(tokens) and torch.equal(
                    out.view(torch.uint8), pages_for(ns_a, tokens).view(torch.uint8)
                )
            dash_url = url(dashboards["redis-username"], dashboards["redis-password"])
            with (
                KVCacheClient(
                    dash_url, ns_d, auth_token_file=str(tmp_path / "dashboards.token"), timeout=3
                ) as d,
                pytest.raises(PermissionError, match="forbidden"),
            ):  # rights: read
                d.put_pages(tokens, pages_for(ns_d, tokens))
            with KVCacheClient(
                dash_url, ns_a, auth_token_file=str(tmp_path / "dashboards.token"), timeout=3
            ) as d:
                assert d.lookup(tokens) == 0  # team-a's entries are not readable to this index user
            with pytest.raises(Exception, match="(?i)permission"):
                PageIndex(dash_url).register_node("rogue", "10.0.0.66:1", 1 << 30, 5000)
            operator = PageIndex(
                url("kvstore-operator", secrets["kv-kvstore-index-users"]["operator-password"])
            )
            assert [n.node_id for n in operator.live_nodes()] == ["node-0"]
    finally:
        server.terminate()
        server.wait(10)


def ping(client) -> bool:
    try:
        return client.ping()
    except redis_errors.ConnectionError:
        return False
