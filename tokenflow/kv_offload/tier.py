"""The scheduler's one handle on the host KV tier.

The TokenFlow scheduler reads the tier (its size, a request's loadable
blocks, the measured transfer speed, the counters) and asks two things of it
(recompute a resume instead of reloading it; spend write-through on the
largest buffers first). `host_tier_of(connector)` gives this handle for the
engine's connector, or None without a TokenFlow host pool; the scheduler
looks once, at start, since the connector is fixed for the engine's life.
"""

from __future__ import annotations

from typing import Callable

from tokenflow.core.sched_state import HostTierCounters
from tokenflow.kv_offload.manager import HostPoolManager


def host_pool_of(connector) -> HostPoolManager | None:
    """The HostPoolManager behind a (stock or TokenFlow) OffloadingConnector, if any."""
    sched = getattr(connector, "connector_scheduler", None)
    manager = getattr(sched, "manager", None)
    return manager if isinstance(manager, HostPoolManager) else None


class HostTier:
    """A host pool, and TokenFlow's connector when that is the one in use
    (vLLM's stock OffloadingConnector over our spec stores and reloads the
    same, but measures no speed and takes no advice)."""

    def __init__(self, pool: HostPoolManager, connector=None):
        self.pool = pool
        self._connector = connector  # a TokenFlowOffloadingConnector, or None

    def transfer_tps(self) -> float | None:
        """Measured host<->device speed in tokens/s; None until measured."""
        return self.pool.counters.transfer_tps if self._connector is not None else None

    def capacity_blocks(self) -> int:
        """This engine's share of the host pool, in engine blocks."""
        return self.pool.num_blocks * self.pool.engine_blocks_per_block

    def request_blocks(self, req_id: str) -> int:
        """Engine blocks of a request that a resume would load from the host."""
        return self.pool.host_blocks_of(req_id)

    def recompute(self, req_id: str) -> None:
        """The policy chose prefill over the transfer for this resume: its
        next lookup reports no host hit."""
        if self._connector is not None:
            self._connector.skip_reload.add(req_id)

    def prioritise_stores(self, buffer_seconds: Callable[[str], float]) -> None:
        """Write-through goes to the requests likeliest to pause (the
        largest buffers) first."""
        if self._connector is not None:
            self._connector.store_priority = buffer_seconds

    def counters(self) -> HostTierCounters:
        c = self.pool.counters
        return HostTierCounters(
            blocks_stored=c.blocks_stored, blocks_loaded=c.blocks_loaded, bytes_stored=c.bytes_stored,
            bytes_loaded=c.bytes_loaded, evictions=c.evictions, lookup_hits=c.lookup_hits,
            lookup_misses=c.lookup_misses, capacity_blocks=c.capacity_blocks,
            reloads_skipped=self._connector.reloads_skipped if self._connector is not None else 0)


def host_tier_of(connector) -> HostTier | None:
    from tokenflow.kv_offload.connector import TokenFlowOffloadingConnector  # imports vLLM

    pool = host_pool_of(connector) if connector is not None else None
    if pool is None:
        return None
    return HostTier(pool, connector if isinstance(connector, TokenFlowOffloadingConnector) else None)
