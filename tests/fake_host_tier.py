"""A host KV tier for the fake engine loop (tests/vllm_loop.py).

On a GPU, TokenFlow's offloading connector writes each full KV block
through to host memory; a request released and resumed gets its full
blocks back by a transfer on its own stream, and vLLM's scheduler then
schedules only the tail (the unfinished block) as prefill in the batch.
The fake loop has no tensors, so this stands in for the smallest piece:
a KV connector whose scheduler side reports a returning request's blocks
on the host as computed, and whose loads `MirrorRunner` performs from its
own host copy of those blocks (taken from the KV it wrote), so a wrong
load still changes the request's tokens. The fake clock charges a load
nothing: on a GPU it does not hold up the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


@dataclass
class HostLoads(KVConnectorMetadata):
    # request id -> (first token position, tokens) to restore from the host
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)


class FakeHostTier(KVConnectorBase_V1):
    """Scheduler side only: the fake loop has no worker (MirrorRunner reads
    the metadata)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.on_host: dict[str, int] = {}  # request id -> tokens whose KV the host holds (whole blocks)
        self._held: dict[str, int] = {}  # what get_num_new_matched_tokens found, until allocated
        self._loads: dict[str, tuple[int, int]] = {}
        self.tokens_loaded = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # The last token is always computed on the device: it makes the next.
        bs = self.block_size
        held = min(self.on_host.get(request.request_id, 0), (request.num_tokens - 1) // bs * bs)
        self._held[request.request_id] = held
        return max(0, held - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        held = self._held.pop(request.request_id, 0)
        if num_external_tokens:
            self._loads[request.request_id] = (held - num_external_tokens, num_external_tokens)
            self.tokens_loaded += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> HostLoads:
        meta, self._loads, self._held = HostLoads(self._loads), {}, {}
        return meta

    def request_finished(self, request, block_ids):
        self.on_host.pop(request.request_id, None)
        return False, None

    # Worker side: never built in the fake loop.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        raise NotImplementedError

    def wait_for_save(self):
        raise NotImplementedError
