"""What the security tests share: a tenant's namespace, a process's command line as
any user of the host reads it, the ``kvstore`` command run as an operator runs it, and
credentials for two tenants made with it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.helpers import KVSTORE_CLI as KVSTORE
from tests.support.helpers import cli_env, namespace_for_page_size

ENV = cli_env()  # no token: each test hands its processes the one it means


def make_ns(tenant: str):
    return namespace_for_page_size(64 << 10, tenant=tenant)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def run_kvstore(*args: str) -> str:
    out = subprocess.run(
        [*KVSTORE, *args], env=ENV, capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def tenant_credentials(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """A credentials file for alice (tenant team-a) and bob (team-b), each line made by
    ``kvstore credential`` (a real process); returns it and each name's token file."""
    lines, tokens = [], {}
    for name, tenant in (("alice", "team-a"), ("bob", "team-b")):
        tokens[name] = tmp_path / f"{name}.token"
        lines.append(
            run_kvstore(
                "credential", "--name", name, "--tenant", tenant, "--token-file", str(tokens[name])
            )
        )
    path = tmp_path / "credentials"
    path.write_text("\n".join(lines) + "\n")
    return path, tokens
