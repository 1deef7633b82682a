"""The public get methods as views of one plan: each is made from its plan builder
(``client.gets.plan``: ``pages_plan`` makes ``get_pages``, ``device_plan``
``get_found_device``, ...), so its signature and documentation are written once, there,
and both clients' methods build the plan and read it. ``AsyncKVCacheClient`` uses
``async_view``, ``KVCacheClient`` ``blocking_view`` (a fault or its deadline gives the
destination's ``miss``). Type checkers and ``help()`` see the builder's parameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from client.gets.plan import GetPlan

P = ParamSpec("P")
R = TypeVar("R")


class Reads(Protocol):
    """A client that reads plans (``AsyncKVCacheClient.read``)."""

    async def read(self, plan: GetPlan[Any]) -> Any: ...


class BlockingReads(Protocol):
    """A blocking client that reads plans (``KVCacheClient.read``)."""

    def read(self, plan: GetPlan[Any]) -> Any: ...


def async_view(
    build: Callable[P, GetPlan[R]],
) -> Callable[Concatenate[Reads, P], Coroutine[Any, Any, R]]:
    """An async method that reads the plan ``build`` makes of its arguments."""

    async def view(self: Reads, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.read(build(*args, **kwargs))

    return named_after(view, build)


def blocking_view(build: Callable[P, GetPlan[R]]) -> Callable[Concatenate[BlockingReads, P], R]:
    """A blocking method that reads the plan ``build`` makes of its arguments."""

    def view(self: BlockingReads, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.read(build(*args, **kwargs))

    return named_after(view, build)


F = TypeVar("F", bound=Callable[..., Any])


def named_after(view: F, build: Callable[..., Any]) -> F:
    """``view`` documented as ``build``, with ``self`` before its parameters."""
    view.__doc__ = build.__doc__
    view.__qualname__ = f"view of {build.__name__}"
    signature = inspect.signature(build)
    self_ = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    view.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_, *signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return view
