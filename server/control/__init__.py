"""The operator control API on a storage node (docs/operations.md, "Steering the cache"):
``pins`` (which pages are pinned, the limits, the pins file), ``ops`` (pin, unpin,
prefetch, clear and residency on the page table, on the node's event loop), ``http``
(the requests on the HTTP server's threads: parsed, authorised, resolved to page keys,
handed to the loop), ``metrics``."""
