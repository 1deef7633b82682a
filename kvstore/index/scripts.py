"""The index's Lua scripts as objects (in ``lua/``, each with ``common.lua`` before it).

Each ``LuaScript`` owns its source and its SHA-1, computed once at import; callers name
a script by its module attribute (``scripts.LOOKUP``), so a wrong name is an import or
lint error, not a failure of the first call. ``kvstore.index.routing`` sends them with
EVALSHA and loads ``ALL`` again when a server answers NOSCRIPT (a restart, a failover,
SCRIPT FLUSH)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def _script(name: str, cross_slot: bool = False) -> LuaScript:
    lua = resources.files("kvstore.index") / "lua"
    # Scripts over segments touch keys of many slots of one shard: a cluster refuses that
    # without the flag (a single server ignores slots). See page_index._segment_call.
    shebang = "#!lua flags=allow-cross-slot-keys\n" if cross_slot else ""
    return LuaScript(name, shebang + (lua / "common.lua").read_text() + (lua / f"{name}.lua").read_text())


LOOKUP = _script("lookup", cross_slot=True)
COMMIT = _script("commit", cross_slot=True)
REMOVE = _script("remove", cross_slot=True)
REGISTER = _script("register")
DEREGISTER = _script("deregister")
LIVE_NODES = _script("live_nodes")
ALL = (LOOKUP, COMMIT, REMOVE, REGISTER, DEREGISTER, LIVE_NODES)
