"""The programs of the floors above that kvstore's tools start, each in a process of its
own and by module name only: kvstore never imports ``server`` or ``client``, and this
module is the one place that names what the tools run (``kvstore server``, ``kvstore
up`` and ``LocalCluster`` start ``STORAGE_NODE``; ``kvstore demo`` starts
``DEMO_WORKER``). A caller may hand ``LocalCluster`` another ``Program`` (a node built
otherwise) at construction."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Program:
    """A Python program run as ``python -m <module>`` with this interpreter."""

    module: str
    description: str

    def argv(self, *args: str) -> list[str]:
        """The command line that runs it with ``args``."""
        return [sys.executable, "-m", self.module, *args]


STORAGE_NODE = Program("server", "a storage node (server/)")
DEMO_WORKER = Program("client.demo_worker", "the demo's prefill and decode processes (client/)")
