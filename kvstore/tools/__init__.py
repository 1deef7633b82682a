"""Developer and operator tools: the kvstore command, the local launcher, embedded Valkey, the demo."""
