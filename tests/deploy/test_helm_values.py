"""The chart's extension points and values that cannot work: the exporter, gigabyte
hugepages, the disk tier's claims, the strict schema, and the dashboard and alerts
reading only series the node exports."""

from __future__ import annotations

import json

import pytest
from helm_python import HelmValuesError

from kvstore.settings.sizes import parse_size
from tests.support.helm_chart import CHART, ROOT, load_values, pods, render, storage_container


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
