"""Worker side of the host KV pool: the copies.

The pool is one host tensor per engine KV tensor, shaped (rows, row_bytes)
in int8, where a row holds `blocks_per_chunk` engine blocks of that tensor.
Under Serve the tensors are views of the engine's slot of its node's shared
pool (host_shm.py, owned by the node's KV pool actor); standalone they are
the worker's own memory.

- CPU backend (`HostPoolWorker`): the engine's KV tensors are CPU tensors
  too, so a transfer is a row-by-row copy, done at submit time. That is safe:
  vLLM submits stores at the start of the next step, before that step's
  forward writes anything, and a loading request is not scheduled until the
  load reports finished.
- CUDA (`cuda_worker`): the pool is pinned, and vLLM's own
  `SingleDirectionOffloadingHandler` (one per direction, each transfer on its
  own CUDA stream, ordered after the compute stream, timed with events) is
  pointed at it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tokenflow.kv_offload.host_shm import Region, map_region

logger = logging.getLogger(__name__)


def make_host_pool(kv_caches: CanonicalKVCaches, num_rows: int, blocks_per_chunk: int,
                   pin_memory: bool, region: Region | None = None) -> tuple[list[torch.Tensor], bool]:
    """One (num_rows, row_bytes) int8 tensor per engine KV tensor: carved out
    of the node pool's shared memory when given a region (its slot), else
    this process's own memory. Also returns whether the pool is pinned."""
    shapes = [(num_rows, t.tensor.shape[1] * blocks_per_chunk) for t in kv_caches.tensors]
    if region is None:
        # Written once here, not just allocated: a zeroed allocation maps pages
        # lazily, so the process would grow by the pool's size as blocks are
        # first used (seen as a creeping RSS in the soak, docs/RELIABILITY.md),
        # and a pool that does not fit would fail mid-burst instead of at start.
        return [torch.empty(shape, dtype=torch.int8, device="cpu", pin_memory=pin_memory).fill_(0)
                for shape in shapes], pin_memory
    flat = map_region(region)
    need = sum(r * c for r, c in shapes)
    if need > flat.numel():
        raise ValueError(f"kv_offload: the host pool needs {need} bytes, its slot has {flat.numel()}")
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return out, pin_memory and pin_mapped(flat)


def pin_mapped(flat: torch.Tensor) -> bool:
    """Page-lock shared memory mapped here, for async DMA (CUDA only); on
    failure the pool stays pageable (slower copies, same results).
    Not exercised on the CPU-only CI machine."""
    err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(err) != 0:
        logger.warning("kv_offload: cudaHostRegister of the shared host pool failed (%s); "
                       "transfers use pageable memory", err)
        return False
    return True


def host_block_rows(rows: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Block-granular rows of a pool viewed as (rows * blocks_per_chunk, block_bytes):
    `count` blocks starting `skip` blocks into the first chunk."""
    if blocks_per_chunk == 1:
        return rows[:count].astype(np.int64)
    flat = (rows.astype(np.int64)[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return flat[skip:skip + count]


@dataclass
class _Copy:
    """One transfer, resolved to index lists per engine tensor."""

    tensor_rows: list[tuple[int, list[int], list[int]]]  # (tensor idx, device blocks, host blocks)
    nbytes: int


class HostPoolWorker(OffloadingWorker):
    """Host pool for the CPU backend: synchronous row copies."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_rows: int, blocks_per_chunk: int,
                 region: Region | None = None):
        self.blocks_per_chunk = blocks_per_chunk
        self.device = [t.tensor for t in kv_caches.tensors]  # (num_blocks, block_bytes) int8 views
        self.host, _ = make_host_pool(kv_caches, num_rows, blocks_per_chunk, pin_memory=False, region=region)
        # The same bytes, one engine block per row, to index like the device side.
        self.host_blocks = [h.view(-1, d.shape[1]) for h, d in zip(self.host, self.device)]
        # Tensors each KV cache group lives in (layers sharing bytes copy once).
        self.group_tensors = [sorted({r.tensor_idx for r in refs}) for refs in kv_caches.group_data_refs]
        self._finished: list[TransferResult] = []

    def _resolve(self, host: BlockIDsLoadStoreSpec, dev: GPULoadStoreSpec) -> _Copy:
        out, nbytes = [], 0
        dev_off = host_off = 0
        bpc = self.blocks_per_chunk
        for g, (count, first) in enumerate(zip(dev.group_sizes, dev.block_indices)):
            if count == 0:
                continue
            skip = first % bpc
            n_rows = -(-(count + skip) // bpc)
            dev_ids = dev.block_ids[dev_off:dev_off + count].tolist()
            host_ids = host_block_rows(host.block_ids[host_off:host_off + n_rows], bpc, skip, count).tolist()
            for t in self.group_tensors[g]:
                out.append((t, dev_ids, host_ids))
                nbytes += count * self.device[t].shape[1]
            dev_off += count
            host_off += n_rows
        return _Copy(out, nbytes)

    # A row-by-row copy_ beats index_copy_ on int8 rows several times over
    # (measured: ~6 GB/s against ~1 GB/s for 32 KiB rows on this CPU).
    def store_blocks(self, copy: _Copy) -> None:
        for t, dev_ids, host_ids in copy.tensor_rows:
            src, dst = self.device[t], self.host_blocks[t]
            for d, h in zip(dev_ids, host_ids):
                dst[h].copy_(src[d])

    def load_blocks(self, copy: _Copy) -> None:
        for t, dev_ids, host_ids in copy.tensor_rows:
            src, dst = self.host_blocks[t], self.device[t]
            for d, h in zip(dev_ids, host_ids):
                dst[d].copy_(src[h])

    def _run(self, job_id: int, fn, copy: _Copy) -> bool:
        t0 = time.perf_counter()
        fn(copy)
        self._finished.append(TransferResult(job_id, True, copy.nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._run(job_id, self.store_blocks, self._resolve(dst_spec, src_spec))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(job_id, self.load_blocks, self._resolve(src_spec, dst_spec))

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies finish inside submit_*

    def shutdown(self) -> None:
        self.host.clear()
        self.host_blocks.clear()


class CudaHostPoolWorker(OffloadingWorker):
    """Host pool for CUDA (and XPU): pinned pool, vLLM's transfer handlers.

    Not exercised on the CPU-only CI machine."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_rows: int, blocks_per_chunk: int,
                 region: Region | None = None):
        from vllm.utils.torch_utils import PIN_MEMORY
        from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

        device = [t.tensor for t in kv_caches.tensors]
        self.host, pinned = make_host_pool(kv_caches, num_rows, blocks_per_chunk, PIN_MEMORY, region)
        common = dict(gpu_tensors=device, cpu_tensors=self.host, blocks_per_chunk=blocks_per_chunk,
                      layer_refs_per_group=kv_caches.group_data_refs, host_memory_is_pinned=pinned)
        self._store = SingleDirectionOffloadingHandler(gpu_to_cpu=True, **common)
        self._load = SingleDirectionOffloadingHandler(gpu_to_cpu=False, **common)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._store.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._load.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._store.get_finished() + self._load.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self._store.wait(job_ids)
        self._load.wait(job_ids)

    def shutdown(self) -> None:
        # Drain both directions before the pool they copy into goes away.
        self._store.shutdown()
        self._load.shutdown()
        self.host.clear()
