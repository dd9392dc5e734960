"""Host-memory KV tier for TokenFlow, plugged into vLLM's OffloadingConnector.

vLLM's connector does the protocol (write-through of every newly full
block, flush of a paused request's pending stores before its blocks are
reused, lookup and load on re-admission); this package supplies the storage:

- spec.TokenFlowOffloadingSpec: the OffloadingSpec vLLM loads by name;
- manager.HostPoolManager: host rows, LRU eviction, counters (scheduler side);
- worker.HostPoolWorker / CudaHostPoolWorker: the copies (worker side);
- connector.TokenFlowOffloadingConnector: exposes the measured speed to the
  TokenFlow scheduler.
- host_shm: a node's pool as one shared-memory file in engine slots (the
  node's KV pool actor owns it; each engine maps its slot).

`kv_transfer_config(...)` builds the engine argument.
"""

from __future__ import annotations

from typing import Any


def kv_transfer_config(host_pool_bytes: int | None = None, host_pool_blocks: int | None = None,
                       tokenflow_connector: bool = True, region=None, **extra: Any) -> dict:
    """kv_transfer_config for vLLM: decode blocks stored too, pool sized here.

    region: a host_shm.Region, the engine's slot of its node's shared pool
    (sizes the pool too). tokenflow_connector=False uses the stock
    OffloadingConnector (same behaviour, but the scheduler cannot read the
    measured transfer speed)."""
    if region is not None:
        extra[region.EXTRA_KEY] = region.to_dict()
        host_pool_bytes = region.nbytes if host_pool_bytes is None else host_pool_bytes
    cfg: dict[str, Any] = {
        "spec_name": "TokenFlowOffloadingSpec",
        "spec_module_path": "tokenflow.kv_offload.spec",
        "offload_prompt_only": False,
        **extra,
    }
    if host_pool_bytes is not None:
        cfg["host_pool_bytes"] = int(host_pool_bytes)
    if host_pool_blocks is not None:
        cfg["host_pool_blocks"] = int(host_pool_blocks)
    out = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}
    if tokenflow_connector:
        out.update(kv_connector="TokenFlowOffloadingConnector", kv_connector_module_path="tokenflow.kv_offload.connector")
    return out
