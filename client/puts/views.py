"""The public put methods as views of one plan: each is made from its plan builder
(``client.puts.plan``: ``pages_put_plan`` makes ``put_pages``, ``keyed_put_plan``
``put_keyed``), so its signature and documentation are written once, there, and both
clients' methods build the plan and put it, as the gets are made
(``client.gets.views``). ``AsyncKVCacheClient`` uses ``async_put_view``,
``KVCacheClient`` ``blocking_put_view`` (past its deadline a put raises
``TransportError``, as every blocking put does). Type checkers and ``help()`` see the
builder's parameters."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol

from client.gets.views import named_after
from client.puts.plan import PutPlan
from client.puts.publish import PublishReport

P = ParamSpec("P")


class Puts(Protocol):
    """A client that puts plans (``AsyncKVCacheClient.put``)."""

    async def put(self, plan: PutPlan) -> PublishReport: ...


class BlockingPuts(Protocol):
    """A blocking client that puts plans (``KVCacheClient.put``)."""

    def put(self, plan: PutPlan) -> PublishReport: ...


def async_put_view(
    build: Callable[P, PutPlan],
) -> Callable[Concatenate[Puts, P], Coroutine[Any, Any, PublishReport]]:
    """An async method that puts the plan ``build`` makes of its arguments."""

    async def view(self: Puts, *args: P.args, **kwargs: P.kwargs) -> PublishReport:
        return await self.put(build(*args, **kwargs))

    return named_after(view, build)


def blocking_put_view(
    build: Callable[P, PutPlan],
) -> Callable[Concatenate[BlockingPuts, P], PublishReport]:
    """A blocking method that puts the plan ``build`` makes of its arguments."""

    def view(self: BlockingPuts, *args: P.args, **kwargs: P.kwargs) -> PublishReport:
        return self.put(build(*args, **kwargs))

    return named_after(view, build)
