"""vLLM's OffloadingConnector plus what TokenFlow's scheduler asks of it.

Load with kv_transfer_config
    kv_connector: TokenFlowOffloadingConnector
    kv_connector_module_path: tokenflow.kv_offload.connector

The scheduler reaches it only through its typed handle (tier.py):
- the measured host<->device speed: the workers measure it (possibly in
  other processes) and it reaches the scheduler side only here, in
  `update_connector_output`; the stock connector folds it into its
  Prometheus stats, out of the manager's sight;
- `skip_reload`: resumes the policy chose to recompute (prefill beats the
  transfer at measured speeds); their next lookup reports no host hit, so
  vLLM prefills them;
- `store_priority`: the scheduler's readers' buffers; each step's store work
  is then capped to a budget and spent on the largest buffers first
  (store_budget.py), by capping vLLM's per-request `max_offload_tokens` for
  that one step.

Extra config keys read here: `store_share` (0.5; share of the engine's time
stores may take; 0 turns the budget off) and `store_max_credit_s` (0.1).
Everything else is the stock connector.
"""

from __future__ import annotations

import time
from itertools import chain

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from tokenflow.kv_offload.manager import HostPoolManager
from tokenflow.kv_offload.store_budget import PendingStore, StoreBudget
from tokenflow.kv_offload.tier import host_pool_of


def store_budget_from(extra: dict) -> StoreBudget | None:
    share = float(extra.get("store_share", StoreBudget.share))
    if share == 0:
        return None
    return StoreBudget(share=share, max_credit_s=float(extra.get("store_max_credit_s", StoreBudget.max_credit_s)))


class TokenFlowOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.store_budget = store_budget_from(extra)
        self.store_priority = None  # req_id -> buffer seconds, from the TokenFlow scheduler
        self.skip_reload: set[str] = set()  # resumes the policy chose to recompute
        self.reloads_skipped = 0

    # --- reload or recompute --------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        # Asked again each step the request waits for memory: the choice holds
        # until it is allocated (update_state_after_alloc) or finished. The
        # stock lookup still runs (it resets the request's block bookkeeping);
        # vLLM's own per-request switch makes it report no host hit.
        if request.request_id not in self.skip_reload:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        saved = request.skip_reading_prefix_cache
        request.skip_reading_prefix_cache = True
        try:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            request.skip_reading_prefix_cache = saved

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if request.request_id in self.skip_reload:
            self.skip_reload.discard(request.request_id)
            self.reloads_skipped += 1
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, block_ids):
        self.skip_reload.discard(request.request_id)
        return super().request_finished(request, block_ids)

    # --- store budget -------------------------------------------------------
    def build_connector_meta(self, scheduler_output):
        s = self.connector_scheduler
        caps = self._store_caps(scheduler_output, s) if s is not None else {}
        saved = {}
        for rid, cap in caps.items():
            st = s._req_status[rid]
            saved[rid] = st.max_offload_tokens
            st.max_offload_tokens = cap if saved[rid] is None else min(cap, saved[rid])
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            # The cap is for this step only; what it held back stays
            # pending (vLLM's pointer stops at the cap) for the next ones.
            for rid, old in saved.items():
                st = s._req_status.get(rid)
                if st is not None:
                    st.max_offload_tokens = old

    def _store_caps(self, so, s) -> dict[str, int]:
        """req_id -> token cap for this step's stores (vLLM's own fields)."""
        budget, pool = self.store_budget, self.host_pool
        # Hybrid models (several KV groups: sliding window, mamba) keep
        # vLLM's stores: a cap there would bend their alignment rules.
        if budget is None or pool is None or len(s.config.kv_group_configs) != 1:
            return {}
        if not budget.refill(pool.counters.store_tps, time.monotonic()):
            return {}
        tpc = s.config.kv_group_configs[0].tokens_per_chunk
        priority = self.store_priority
        pending = []
        for rid in chain(so.num_scheduled_tokens, so.finished_req_ids or ()):
            st = s._req_status.get(rid)
            if st is None:
                continue
            req = st.req
            # The same horizon vLLM computes in _build_store_jobs.
            if req.is_finished():
                end = max(req.num_prompt_tokens, req.num_tokens - 1)
            else:
                end = req.num_computed_tokens + so.num_scheduled_tokens[rid]
            nxt = st.group_states[0].next_stored_chunk_idx
            ready = s._calc_num_offloadable_tokens(st, end) // tpc - nxt
            if ready > 0:
                prio = float("-inf") if req.is_finished() else (priority(rid) if priority else 0.0)
                pending.append(PendingStore(rid, prio, nxt, ready))
        return {rid: chunk * tpc for rid, chunk in budget.allot(pending, tpc).items()}

    @property
    def host_pool(self) -> HostPoolManager | None:
        return host_pool_of(self)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        pool = self.host_pool
        if pool is not None and isinstance(meta, OffloadingWorkerMetadata):
            s = meta.transfer_stats
            pool.record_transfer(s.load.bytes, s.load.time, s.store.bytes, s.store.time)
        super().update_connector_output(connector_output)
