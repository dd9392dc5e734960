"""Andes (arXiv 2404.16283) as the TokenFlow paper re-implemented it: a greedy
knapsack over KV blocks, run only when KV use is high, preempting by
recompute. It answers in the same Decision terms as TokenFlowPolicy so the
scheduler adapter runs either. Pure Python.

Value of serving request i for a look-ahead window T: the QoE it would lose
if paused instead. Expected reading over T is r*T tokens; paused, the reader
is short max(0, r*T - b); served at s tokens/s, short max(0, r*T - b - s*T).
The gain, normalised by r*T, is divided by the request's KV blocks (value
density); running requests get a bonus (1.5x) to limit churn.
"""

from __future__ import annotations

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policy import Decision, EngineView, Phase, QueueCounts, RequestColumns, RequestView


class AndesPolicy:
    def __init__(self, cfg: TokenFlowConfig):
        self.cfg = cfg

    def needs_decision(self, q: QueueCounts) -> bool:
        return True  # Andes' own trigger (KV use) is in decide()

    def decide(self, reqs: RequestColumns | list[RequestView], eng: EngineView) -> Decision | None:
        cfg = self.cfg
        if isinstance(reqs, RequestColumns):  # the scheduler's snapshot: Andes reads requests one by one
            reqs = reqs.views()
        used = eng.total_blocks - eng.free_blocks
        waiting = any(r.phase == Phase.WAITING for r in reqs)
        paused = any(r.phase == Phase.PAUSED for r in reqs)
        if not paused and (not waiting or used < cfg.andes_kv_trigger * eng.total_blocks):
            return None
        ranked = sorted(reqs, key=lambda r: self.density(r, eng), reverse=True)
        budget = eng.total_blocks - int(cfg.kv_headroom * eng.total_blocks)
        chosen, total = set(), 0
        for r in ranked:
            if len(chosen) >= eng.max_num_seqs:
                break
            if total + r.blocks > budget and chosen:
                continue
            chosen.add(r.req_id)
            total += r.blocks
        d = Decision(order=[r.req_id for r in ranked if r.req_id in chosen])
        for r in reqs:
            if r.phase == Phase.WAITING:
                (d.admit if r.req_id in chosen else d.wait).append(r.req_id)
            elif r.req_id in chosen:
                d.run.append(r.req_id)
            else:
                d.pause_release.append(r.req_id)  # Andes preempts by recompute
        return d

    def density(self, r: RequestView, eng: EngineView) -> float:
        window = self.cfg.andes_window_s
        speed = eng.step_rate or 1.0 / self.cfg.dt
        need = r.rate * window
        short_paused = max(0.0, need - r.buffer_tokens)
        short_served = max(0.0, need - r.buffer_tokens - speed * window)
        gain = (short_paused - short_served) / need
        if r.phase == Phase.RUNNING:
            gain *= self.cfg.andes_running_bonus
        return gain / max(1, r.blocks)
