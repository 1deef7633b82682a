"""What any engine's connector needs to page KV into and out of the store, with no
engine import: the paged cache's gathers and scatters (``paged_cache``, with the
one-launch GPU gather in ``gather_pages``), the host page buffers they stage through
(``staging_pool``), the load path (``loader``), the circuit breaker (``breaker``) and
the load and save specs a scheduler hands its workers (``specs``). The vLLM connector
(``client.vllm``) builds on them."""
