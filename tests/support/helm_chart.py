"""The Helm chart rendered offline (helm-python-sdk) for the test_helm* files: values,
rendered objects, the storage container and its options as the node parses them."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import yaml
from helm_python import Chart

from kvstore.settings.config import ServerSettings
from tests.support.paths import ROOT

CHART = ROOT / "helm" / "kvstore"


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


def pods(objects) -> dict[str, dict]:
    """Pod specs of the storage and index workloads, by component."""
    out = {}
    for kind in ("StatefulSet", "DaemonSet"):
        for w in objects.get(kind, []):
            out[w["metadata"]["name"].rsplit("-", 1)[-1]] = w["spec"]["template"]["spec"]
    return out
