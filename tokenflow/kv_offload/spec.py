"""The OffloadingSpec vLLM's OffloadingConnector loads from kv_connector_extra_config
("spec_name": "TokenFlowOffloadingSpec", "spec_module_path": "tokenflow.kv_offload.spec").

Extra config keys read here (besides vLLM's own, e.g. offload_prompt_only,
blocks_per_chunk):
    host_pool_bytes   host pool size, all workers together
    host_pool_blocks  or the size in blocks (chunks); wins over bytes
    cpu_bytes_to_use  accepted as an alias of host_pool_bytes
    host_pool_shm     the engine's slot of its node's shared pool (a
                      host_shm.Region as a dict, handed out by the node's KV
                      pool actor); absent: the pool is this process's memory
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from tokenflow.kv_offload.host_shm import Region
from tokenflow.kv_offload.manager import HostPoolManager
from tokenflow.kv_offload.worker import CudaHostPoolWorker, HostPoolWorker


@dataclass(frozen=True)
class HostPoolConfig:
    pool_bytes: int | None = None
    pool_blocks: int | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "HostPoolConfig":
        size = extra.get("host_pool_bytes", extra.get("cpu_bytes_to_use"))
        blocks = extra.get("host_pool_blocks")
        return cls(int(size) if size is not None else None, int(blocks) if blocks is not None else None)

    def num_blocks(self, bytes_per_block: int) -> int:
        if self.pool_blocks is not None:
            n = self.pool_blocks
        elif self.pool_bytes is not None:
            n = self.pool_bytes // max(bytes_per_block, 1)
        else:
            raise ValueError("kv_offload: set host_pool_bytes or host_pool_blocks in kv_connector_extra_config")
        if n < 1:
            raise ValueError(f"kv_offload: host pool holds no block ({bytes_per_block} bytes each); make it larger")
        return n


class TokenFlowOffloadingSpec(OffloadingSpec):
    # Tests swap this for a deliberately broken worker.
    cpu_worker_cls: type[OffloadingWorker] = HostPoolWorker
    cuda_worker_cls: type[OffloadingWorker] = CudaHostPoolWorker

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if config.canonical_layout or config.replicated_layout:
            raise ValueError("kv_offload: canonical/replicated host layouts are not supported")
        self.pool = HostPoolConfig.from_extra(self.extra_config)
        world = max(config.parallel.world_size, 1)
        # One host row is one chunk (blocks_per_chunk engine blocks) on every worker.
        self.worker_bytes_per_row = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.bytes_per_row = self.worker_bytes_per_row * world
        # worker_kv_bytes_per_block is 0 on a config with no KV cache (never used then).
        self.num_rows = self.pool.num_blocks(self.bytes_per_row) if config.worker_kv_bytes_per_block else 0
        # Each worker of the engine maps its own consecutive part of the slot.
        self.region = Region.from_extra(self.extra_config)
        self.worker_index = config.parallel.rank % world
        self._manager: HostPoolManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> HostPoolManager:
        if self._manager is None:
            tokens_per_block = self.tokens_per_block[0]
            self._manager = HostPoolManager(
                num_blocks=self.num_rows,
                bytes_per_block=self.bytes_per_row,
                bytes_per_token=self.config.worker_kv_bytes_per_block / tokens_per_block,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                engine_blocks_per_block=self.blocks_per_chunk,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            kind = kv_caches.tensors[0].tensor.device.type
            if kind == "cpu":
                cls = self.cpu_worker_cls
            elif kind in ("cuda", "xpu"):
                cls = self.cuda_worker_cls
            else:
                raise NotImplementedError(f"kv_offload: no transfer handler for {kind} KV caches")
            region = self.region and self.region.part(self.worker_index, self.num_rows * self.worker_bytes_per_row)
            self._worker = cls(kv_caches, self.num_rows, self.blocks_per_chunk, region=region)
        return self._worker
