"""The data plane: serving PUT and GET requests (docs/protocol.md).

plane.py admits connections and hands out requests; put.py and get.py serve them;
connection.py, ucx.py and same_host.py move pages over the two paths (lending.py
lends a same-host client the pool's slabs); auth.py and namespaces.py check what a
request may touch; readthrough.py brings pages back from the tier below memory."""

from server.dataplane.plane import DataPlane, RequestLimits

__all__ = ["DataPlane", "RequestLimits"]
