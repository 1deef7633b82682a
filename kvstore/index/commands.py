"""One command of a batch for the index: what the method modules (``lookups``,
``publish``, ``registry``) build and a router (``kvstore.index.routing``) sends."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Cmd:
    """One command of a batch: a plain command, or a script (``script``, a
    ``kvstore.index.scripts.LuaScript``, and
    ``args`` holds its keys then its arguments, ``nkeys`` long; a ``readonly`` script is
    sent with EVALSHA_RO, which users with read-only access to its keys may run).
    Routed by ``key`` (its slot's shard) or to shard number ``shard``; ``parse`` reads
    the raw reply."""

    args: tuple[Any, ...]
    key: str | None = None
    shard: int | None = None
    script: Any = None  # a kvstore.index.scripts.LuaScript
    nkeys: int = 0
    parse: Callable[[Any], Any] = lambda raw: raw
    readonly: bool = False

    @staticmethod
    def run_script(
        script: Any,
        keys: Sequence[str],
        argv: Sequence[Any],
        parse: Callable[[Any], Any] = lambda raw: raw,
        *,
        readonly: bool = False,
    ) -> Cmd:
        return Cmd(
            (*keys, *argv),
            key=keys[0] if keys else None,
            script=script,
            nkeys=len(keys),
            parse=parse,
            readonly=readonly,
        )
