"""The operator control API: pin, unpin, prefetch, clear, and where a prefix lives.

``requests``: what ``POST /v1/kv/{pin,unpin,prefetch,clear}`` take and answer, shared by
the storage node (server/control/) and the callers (``kvstore.control.caller``, used by
``KVCacheClient`` and the ``kvstore pin|unpin|clear|prefetch|where`` commands)."""
