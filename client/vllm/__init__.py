"""The vLLM v1 connector in parts. ``client.vllm.connector.KVStoreConnector`` is the
facade vLLM loads (configs name it as ``client.vllm_connector``, which re-exports it):
it builds the side its role needs and delegates every method.

- ``options``: the connector's keys of ``kv_connector_extra_config``, the engine's
  namespace;
- ``transfer_params``: what a request's ``kv_transfer_params`` say: per-request switches,
  the pin of what it saves (``pins``: issued once its saves are published) and the P/D
  handoff's announcement (``claims``: the decode scheduler's claims of
  announced prefixes; ``remote_prefill``: the decode worker's wait for them);
- ``metadata``: what the scheduler hands the workers each step (``client.paging.specs``
  in vLLM's metadata);
- ``scheduler``: lookups, pending loads, the blocks of requests to save, the breaker;
- ``worker``: the paged cache, loader and saver threads, the staging pool;
- ``stats``, ``events``, ``drafts``, ``support``, ``preflight``: their tools.

What is engine-neutral (paged copies, staging, the load path, the breaker) is in
``client.paging``, which imports nothing of vLLM."""
