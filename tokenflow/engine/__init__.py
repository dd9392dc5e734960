"""The vLLM adapter: TokenFlow's scheduler as vLLM's `scheduler_cls`, and the
EngineCore utility the engine replica reads it through. With kv_offload/,
the only code that touches vLLM internals."""
