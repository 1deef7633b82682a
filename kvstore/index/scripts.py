"""The index's Lua scripts as objects (in ``lua/``, each with ``common.lua`` before it),
and how a call of a segment script is put together.

Each ``LuaScript`` owns its source and its SHA-1, computed once at import; callers name
a script by its module attribute (``scripts.LOOKUP``), so a wrong name is an import or
lint error, not a failure of the first call. ``kvstore.index.routing`` sends them with
EVALSHA and loads ``ALL`` again when a server answers NOSCRIPT (a restart, a failover,
SCRIPT FLUSH)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvstore.index.commands import Cmd
from kvstore.pages import keys


@dataclass(frozen=True)
class LuaScript:
    """One script's source (``common.lua`` and its own file) and the SHA-1 that EVALSHA names."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def _script(name: str, cross_slot: bool = False) -> LuaScript:
    lua = resources.files("kvstore.index") / "lua"
    # Scripts over segments touch keys of many slots of one shard: a cluster refuses that
    # without the flag (a single server ignores slots). See segment_call.
    shebang = "#!lua flags=allow-cross-slot-keys\n" if cross_slot else ""
    return LuaScript(
        name, shebang + (lua / "common.lua").read_text() + (lua / f"{name}.lua").read_text()
    )


LOOKUP = _script("lookup", cross_slot=True)
LEASE = _script("lease", cross_slot=True)
COMMIT = _script("commit", cross_slot=True)
REMOVE = _script("remove", cross_slot=True)
REGISTER = _script("register")
DEREGISTER = _script("deregister")
LIVE_NODES = _script("live_nodes")
ALL = (LOOKUP, LEASE, COMMIT, REMOVE, REGISTER, DEREGISTER, LIVE_NODES)


def segment_call(
    script: LuaScript, prefix: str, first: bytes, head: list[Any], anchors_hex: str, tail: list[Any]
) -> Cmd:
    """A call of a segment script (lookup, lease, commit, remove), for the index's
    lookups and publishing: ``head`` arguments, the key prefix and the segments' anchors
    in hex, then ``tail`` arguments. The script builds the key names (common.lua); only
    the first segment's key is declared, to route the call: a cluster refuses declared
    keys of several slots even with the script flag allow-cross-slot-keys (measured on
    Valkey 9.1), which lets the script touch them."""
    return Cmd.run_script(
        script, [keys.segment_key(prefix, first)], [*head, prefix, anchors_hex, *tail]
    )
