"""The TokenFlow scheduling policy (paper, "The scheduler"). Pure Python.

Given a snapshot of every live request and of the engine, decide which
requests hold the accelerator for the next interval: which keep running,
which pause (keeping their KV or releasing it), which resume, and which
waiting requests are admitted. The policy owns no engine state; the vLLM
adapter (tokenflow/scheduler.py) builds the snapshot and applies the result.

Steps, as in the paper:
 1. Stress check: act only when requests wait, paused requests exist, or a
    running reader is about to run dry.
 2. Overload fallback: when the readers' required rates exceed the measured
    decode capacity, resume everything in arrival order (FCFS).
 3. Working set: W_static = floor(M / beta); when few run,
    W_scheduled = W_static - lambda * (W_static - N_running) bounds admission.
 4. Pinning: a running request whose buffer does not cover
    mu * r * (t_evict + t_load + dt) may not be paused; a paused request
    below the critical buffer must resume.
 5. Priority: U_i = (useful tokens in the next dt) + gamma * exp(-b_i / r_i).
    The paper writes the penalty as a cost of *pausing*; ranking by the
    value of *running* adds it instead. Highest U runs while KV blocks and
    sequence slots last; of the rest, the largest buffers release KV first.
 6. Resume mode: reload from host when its I/O time is below the prefill
    time of the context, else recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from tokenflow.buffer import EFFECTIVE_HIGH_FRACTION
from tokenflow.config import TokenFlowConfig


class Phase(str, Enum):
    WAITING = "waiting"  # not admitted yet (new, or released and queued)
    RUNNING = "running"
    PAUSED = "paused"  # parked by us; `kv_resident` says whether it kept its KV


@dataclass
class RequestView:
    req_id: str
    phase: Phase
    arrival_time: float
    rate: float  # reader's tokens/s
    buffer_tokens: float  # delivered but unread now
    num_output: int  # tokens generated so far
    max_tokens: int
    num_tokens: int  # context length: prompt + generated
    blocks: int  # KV blocks it needs resident to run
    kv_resident: bool = False  # its blocks are on the accelerator now
    host_blocks: int = 0  # of its blocks, how many the host tier holds

    @property
    def buffer_s(self) -> float:
        return self.buffer_tokens / self.rate


@dataclass
class EngineView:
    now: float
    block_size: int
    total_blocks: int
    free_blocks: int
    max_num_seqs: int
    decode_tps: float | None = None  # measured aggregate decode tokens/s (capacity)
    step_rate: float | None = None  # measured decode steps/s = tokens/s per request
    prefill_tps: float | None = None  # measured prefill tokens/s
    transfer_tps: float | None = None  # host<->device KV tokens/s; None: no offload
    host_blocks: int = 0  # this engine's share of the host KV pool, in blocks


@dataclass
class Decision:
    run: list[str] = field(default_factory=list)  # on the accelerator next interval
    pause_hold: list[str] = field(default_factory=list)  # pause, keep KV
    pause_release: list[str] = field(default_factory=list)  # pause, free KV
    admit: list[str] = field(default_factory=list)  # waiting requests let in now
    defer: list[str] = field(default_factory=list)  # waiting requests held back
    reload: list[str] = field(default_factory=list)  # released ones to reload, not recompute
    fallback_fcfs: bool = False


def is_stressed(reqs: list[RequestView], cfg: TokenFlowConfig) -> bool:
    for r in reqs:
        if r.phase in (Phase.WAITING, Phase.PAUSED):
            return True
        if r.num_output > 0 and r.buffer_s < cfg.critical_buffer_s:
            return True
    return False


def fcfs_decision(reqs: list[RequestView]) -> Decision:
    """Everyone runs or is admitted in arrival order; vLLM packs memory."""
    d = Decision(fallback_fcfs=True)
    for r in sorted(reqs, key=lambda r: r.arrival_time):
        (d.admit if r.phase == Phase.WAITING else d.run).append(r.req_id)
    return d


class TokenFlowPolicy:
    def __init__(self, cfg: TokenFlowConfig):
        self.cfg = cfg

    def decide(self, reqs: list[RequestView], eng: EngineView) -> Decision | None:
        """None means: no stress, leave vLLM's batch as it is."""
        cfg = self.cfg
        if not is_stressed(reqs, cfg):
            return None
        active = [r for r in reqs if r.phase != Phase.WAITING]
        required = sum(r.rate for r in active)
        if eng.decode_tps and required > cfg.overload_factor * eng.decode_tps:
            return fcfs_decision(reqs)

        waiting = sorted((r for r in reqs if r.phase == Phase.WAITING), key=lambda r: r.arrival_time)
        room = self.working_set_room(reqs, eng)
        admitted = waiting[:room]  # the rest stay deferred
        candidates = active + admitted

        pinned = [r for r in candidates if self.must_run(r, eng)]
        pinned.sort(key=lambda r: r.buffer_s)
        pinned_ids = {r.req_id for r in pinned}
        rest = [r for r in candidates if r.req_id not in pinned_ids]
        rest.sort(key=lambda r: self.priority(r, eng), reverse=True)

        chosen = self.pack(pinned + rest, eng)
        return self.to_decision(reqs, chosen, eng)

    # --- pieces -----------------------------------------------------------
    def working_set_room(self, reqs: list[RequestView], eng: EngineView) -> int:
        """How many waiting requests may join the working set now (step 3)."""
        cfg = self.cfg
        n_running = sum(r.phase == Phase.RUNNING for r in reqs)
        n_current = sum(r.phase != Phase.WAITING for r in reqs)
        # beta: the mean footprint of the requests we hold now, plus what one
        # interval of decoding adds to it.
        grow = (eng.step_rate or 1.0) * cfg.dt / eng.block_size
        beta = max(1.0, sum(r.blocks for r in reqs) / len(reqs) + grow)
        # The working set may exceed device memory: the excess lives in the
        # host pool, or (without offload) is recomputed on resume.
        if eng.transfer_tps:
            memory = eng.total_blocks + eng.host_blocks
        else:
            memory = eng.total_blocks * (1 + cfg.recompute_overcommit)
        w_static = max(1, math.floor(memory / beta))
        w_max = eng.max_num_seqs
        w_sched = w_static
        if n_running < w_max:
            w_sched = w_static - cfg.working_set_lambda * (w_static - n_running)
        # Never fewer than one newcomer when nothing runs, or the engine idles.
        return max(0 if n_running else 1, math.floor(w_sched) - n_current)

    def away_time(self, r: RequestView, eng: EngineView) -> float:
        """How long a request is gone if paused now: evict + load + one interval."""
        tokens = r.num_tokens
        if eng.transfer_tps:
            io = 2 * tokens / eng.transfer_tps
        else:
            io = tokens / eng.prefill_tps if eng.prefill_tps else 0.0
        return io + self.cfg.dt

    def must_run(self, r: RequestView, eng: EngineView) -> bool:
        if r.phase == Phase.RUNNING:
            if r.num_output == 0:
                return True  # mid-prefill: pausing would waste the work done
            return r.buffer_tokens < self.cfg.mu * r.rate * self.away_time(r, eng)
        if r.phase == Phase.PAUSED:
            return r.buffer_s < self.cfg.critical_buffer_s
        return False

    def priority(self, r: RequestView, eng: EngineView) -> float:
        """U_i: useful tokens in the next dt if run, plus the low-buffer penalty."""
        dt = self.cfg.dt
        speed = eng.step_rate or 1.0 / dt
        useful_cap = EFFECTIVE_HIGH_FRACTION * r.max_tokens
        useful = min(speed * dt, max(0.0, useful_cap - r.buffer_tokens + r.rate * dt))
        return useful + self.cfg.gamma * math.exp(-r.buffer_s)

    def pack(self, ordered: list[RequestView], eng: EngineView) -> list[RequestView]:
        """Take requests in order while sequence slots and KV blocks last."""
        budget = eng.total_blocks - math.ceil(self.cfg.kv_headroom * eng.total_blocks)
        grow = math.ceil((eng.step_rate or 1.0) * self.cfg.dt / eng.block_size)
        chosen, used = [], 0
        for r in ordered:
            if len(chosen) >= eng.max_num_seqs:
                break
            need = r.blocks + (grow if r.phase != Phase.WAITING else 0)
            if used + need > budget and chosen:
                continue
            chosen.append(r)
            used += need
        return chosen

    def to_decision(self, reqs, chosen, eng: EngineView) -> Decision:
        d = Decision()
        chosen_ids = {r.req_id for r in chosen}
        for r in chosen:  # in priority order: vLLM preempts from the tail
            if r.phase == Phase.WAITING:
                d.admit.append(r.req_id)
                continue
            d.run.append(r.req_id)
            if r.phase == Phase.PAUSED and not r.kv_resident and self.reload_beats_recompute(r, eng):
                d.reload.append(r.req_id)
        d.defer = [r.req_id for r in reqs if r.phase == Phase.WAITING and r.req_id not in chosen_ids]
        # Unchosen resident requests: free KV only as far as the chosen need it,
        # largest buffers first; the rest pause holding their blocks.
        losers = [r for r in reqs if r.req_id not in chosen_ids and r.phase != Phase.WAITING]
        need = sum(r.blocks for r in chosen if not r.kv_resident)
        free = eng.free_blocks
        for r in sorted(losers, key=lambda r: r.buffer_tokens, reverse=True):
            if not r.kv_resident:
                d.pause_release.append(r.req_id)  # already released: stays so
            elif free < need:
                d.pause_release.append(r.req_id)
                free += r.blocks
            else:
                d.pause_hold.append(r.req_id)
        return d

    def reload_beats_recompute(self, r: RequestView, eng: EngineView) -> bool:
        if not eng.transfer_tps or r.host_blocks == 0:
            return False
        t_io = r.host_blocks * eng.block_size / eng.transfer_tps
        t_prefill = r.num_tokens / eng.prefill_tps if eng.prefill_tps else math.inf
        return t_io < t_prefill
