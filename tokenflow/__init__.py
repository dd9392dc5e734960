"""TokenFlow: buffer-aware scheduling for streaming LLM serving on vLLM and Ray Serve.

Layers, each importing only those below it: core/ (the paper, pure Python),
kv_offload/ then engine/ (the vLLM adapter: the host KV tier, the scheduler),
serve/ (Ray Serve), tools/."""
