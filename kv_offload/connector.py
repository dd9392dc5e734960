"""vLLM's OffloadingConnector plus the two things TokenFlow reads from it.

Load with kv_transfer_config
    kv_connector: TokenFlowOffloadingConnector
    kv_connector_module_path: kv_offload.connector

- `tokenflow_transfer_tps()`: the measured host<->device speed in tokens/s
  (the TokenFlow scheduler looks for it on `self.connector`).
- `tokenflow_host_blocks()`, `tokenflow_request_host_blocks(req_id)`: pool
  capacity and a request's loadable blocks, for the policy's views.
- `host_pool`: the scheduler-side HostPoolManager and its counters.

Why a subclass: the speed is measured on the workers (possibly other
processes) and reaches the scheduler only inside the connector's
`update_connector_output`; the stock connector folds it into its Prometheus
stats, out of the manager's sight. Everything else is the stock connector.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kv_offload.manager import HostPoolManager


def host_pool_of(connector) -> HostPoolManager | None:
    """The HostPoolManager behind a (stock or TokenFlow) OffloadingConnector, if any."""
    sched = getattr(connector, "connector_scheduler", None)
    manager = getattr(sched, "manager", None)
    return manager if isinstance(manager, HostPoolManager) else None


class TokenFlowOffloadingConnector(OffloadingConnector):
    @property
    def host_pool(self) -> HostPoolManager | None:
        return host_pool_of(self)

    def tokenflow_transfer_tps(self) -> float | None:
        pool = self.host_pool
        return pool.counters.transfer_tps if pool is not None else None

    def tokenflow_host_blocks(self) -> int:
        """Host pool capacity in engine blocks (for EngineView.host_blocks)."""
        pool = self.host_pool
        return pool.num_blocks * pool.engine_blocks_per_block if pool is not None else 0

    def tokenflow_request_host_blocks(self, req_id: str) -> int:
        """Blocks of a request a resume would load (for RequestView.host_blocks)."""
        pool = self.host_pool
        return pool.host_blocks_of(req_id) if pool is not None else 0

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        pool = self.host_pool
        if pool is not None and isinstance(meta, OffloadingWorkerMetadata):
            s = meta.transfer_stats
            pool.record_transfer(s.load.bytes, s.load.time, s.store.bytes, s.store.time)
        super().update_connector_output(connector_output)
