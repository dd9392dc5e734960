"""The vLLM V1 scheduler plugin: a thin adapter between vLLM and the policy.

Enable with engine args
    scheduler_cls: tokenflow.engine.scheduler.TokenFlowScheduler        # CPU / sync
    scheduler_cls: tokenflow.engine.scheduler.TokenFlowAsyncScheduler   # GPU, async scheduling
    additional_config: {tokenflow: {policy: tokenflow, dt: 0.5, ...}}

Every `dt` seconds the adapter snapshots the requests, asks the policy, and
applies its answer by moving requests between vLLM's queues and its own
parking lots; between decisions vLLM batches as usual, and a slot that a
finished request frees goes to the held request the decision ranked next
(an engine left with nothing to run decides at once). A pause either keeps
the request's KV blocks (it just leaves `running`) or releases them (vLLM's
own preemption; on resume vLLM re-admits it, reloading KV from the offload
connector or recomputing). Parked requests still count as unfinished and
are handled on abort.

Under async scheduling (the GPU loop) the policy acts while every running
request has a step in flight; both pauses are applied anyway:
- release goes through vLLM's `_preempt_request`, which marks the in-flight
  output stale: its token is still delivered and kept, and the resumed
  request recomputes from zero, so the token is neither lost nor doubled;
- hold just leaves the next batch, as a running request that vLLM's token
  budget leaves out does: its in-flight token lands as usual, and when it
  runs again vLLM sends the runner its full token list (it was not in the
  previous step).
A parked request is put back only once no step of it is in flight (the
resume waits a step otherwise), so a resumed request never overtakes its
own output. tests/vllm_loop.py drives vLLM's real loop to check all this.

This module is the only one (with tokenflow/kv_offload/) that touches vLLM internals.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import repeat
from operator import attrgetter

import numpy as np

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tokenflow.core.andes import AndesPolicy
from tokenflow.core.buffer import ReaderBuffer
from tokenflow.core.config import RATE_KEY, TokenFlowConfig, parse_carried, parse_rate
from tokenflow.core.meters import EngineMeters
from tokenflow.core.columns import PAUSED, RUNNING, WAITING, RequestColumns
from tokenflow.core.policy import Decision, EngineView, QueueCounts, TokenFlowPolicy
from tokenflow.core.sched_state import SchedulerState, SchedulerStats
from tokenflow.engine import core_utility  # noqa: F401  (the replica's way in: an EngineCore utility)
from tokenflow.engine.request_table import RequestTable
from tokenflow.engine.trace import DecisionTrace
from tokenflow.kv_offload.tier import host_tier_of

logger = logging.getLogger(__name__)

_ID, _DRY_AT, _OUTPUT = attrgetter("request_id"), attrgetter("dry_at"), attrgetter("_output_token_ids")
_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # waiting requests the policy may admit
# The snapshot's four groups of requests, in its order: running, held,
# released, waiting; each group's phase and whether its KV is resident.
_GROUP_PHASE = np.array([RUNNING, PAUSED, PAUSED, WAITING], dtype=np.int8)
_GROUP_RESIDENT = np.array([True, True, False, False])


def make_policy(cfg: TokenFlowConfig):
    if cfg.policy == "tokenflow":
        return TokenFlowPolicy(cfg)
    if cfg.policy == "andes":
        return AndesPolicy(cfg)
    return None  # fcfs: vLLM decides alone


class TokenFlowMixin:
    """Buffer-aware preemption on top of a vLLM Scheduler subclass."""

    clock = staticmethod(time.monotonic)  # tests inject a fake clock

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config or {}
        self.tf_config = TokenFlowConfig.from_dict(extra.get("tokenflow"))
        self.policy = make_policy(self.tf_config)
        self.readers: dict[str, ReaderBuffer] = {}
        self.table = RequestTable()  # each live request's fixed facts, for the snapshot
        self.held: dict[str, Request] = {}  # paused, KV kept
        self.released: dict[str, Request] = {}  # paused, KV freed
        # Waiting, beyond the working set: out of vLLM's queue until the next
        # decision (a freed slot would admit them otherwise).
        self.deferred: dict[str, Request] = {}
        self.meters = EngineMeters.new()
        self.tf_stats = SchedulerStats()
        self._next_decision = 0.0
        # When each step in flight was scheduled (two at once under async
        # scheduling), and when the last step's output came in.
        self._scheduled_at: deque[float] = deque(maxlen=8)
        self._last_output_at: float | None = None
        # Resumes decided while a step of the request was still in flight.
        self._resume_next: list[str] = []
        # The last decision's standby (Decision.standby), and how many
        # running requests have finished since it: the slots they freed.
        self._standby: list[str] = []
        self._freed = 0
        # (requests seen, wall seconds) of each recent decision, the
        # snapshot, the policy and the apply together.
        self.reschedule_seconds: deque[tuple[int, float]] = deque(maxlen=4096)
        self._computed_at_release: dict[str, int] = {}
        # The host KV tier (None without one); the connector is fixed for
        # the engine's life, so look once.
        self.host_tier = host_tier_of(self.connector)
        if self.host_tier is not None:
            self.host_tier.prioritise_stores(self._buffer_seconds_of)
        self._trace = DecisionTrace.from_env()  # None unless TOKENFLOW_TRACE_DIR is set
        logger.info("TokenFlow scheduler: %s%s", self.tf_config,
                    f"; tracing decisions to {self._trace.path}" if self._trace else "")

    def set_clock(self, clock) -> None:
        """Read time from `clock` from now on (the lockstep bench gives each
        engine its own), forgetting the times read off the old one."""
        self.clock = clock
        self._scheduled_at.clear()
        self._last_output_at = None
        self._next_decision = 0.0

    # --- vLLM hooks -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        extra = request.sampling_params.extra_args if request.sampling_params else None
        value = (extra or {}).get(RATE_KEY)
        try:
            rate = parse_rate(value, self.tf_config)
        except ValueError:
            # The HTTP layer rejects bad rates with a 400; a direct engine
            # user gets the default rather than a dead engine.
            logger.warning("request %s: bad consumption_rate %r, using default", request.request_id, value)
            rate = self.tf_config.default_rate
        reader = self.readers[request.request_id] = self._reader_of(extra, rate)
        self.table.add(request.request_id, reader.arrival_time, reader.rate, request.max_tokens,
                       request.num_prompt_tokens)

    def _reader_of(self, extra: dict | None, rate: float) -> ReaderBuffer:
        """A new request's reader; a stream continued from a lost engine
        brings its reader's unread tokens along (tokenflow/serve/continuation.py)."""
        now = self.clock()
        if (carried := parse_carried(extra)) is None:
            return ReaderBuffer(rate=rate, arrival_time=now, history=False)
        return ReaderBuffer.continued(rate, now, *carried, history=False)

    def schedule(self, *args, **kwargs):
        now = self.clock()
        if self._resume_next:
            self._resume(self._resume_next)
        if self.policy is not None and (now >= self._next_decision or self._idle_while_parked()):
            self._next_decision = now + self.tf_config.dt
            self._reschedule(now)
        elif self._freed and self._standby:
            self._fill_freed_slots()
        self._scheduled_at.append(now)
        out = super().schedule(*args, **kwargs)
        if self._computed_at_release:
            self._count_recompute(out)
        self.tf_stats.max_running = max(self.tf_stats.max_running, len(self.running))
        used = self.kv_cache_config.num_blocks - self.kv_cache_manager.block_pool.get_num_free_blocks()
        self.tf_stats.max_blocks_used = max(self.tf_stats.max_blocks_used, used)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        result = super().update_from_output(scheduler_output, model_runner_output)
        now = self.clock()
        self._measure_step(scheduler_output, now)
        self._observe(result, now)
        return result

    def finish_requests(self, request_ids, finished_status: RequestStatus):
        # Put parked requests back where vLLM expects them, then let vLLM
        # finish them as usual (it frees blocks and reports the abort).
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or self.requests)
        for req_id in ids:
            if (req := self.held.pop(req_id, None)) is not None:
                self.running.append(req)
            elif (req := self.released.pop(req_id, None)) is not None:
                self.waiting.prepend_request(req)
            elif (req := self.deferred.pop(req_id, None)) is not None:
                self.waiting.add_request(req)
        done = super().finish_requests(ids, finished_status)
        for req in done:
            self._forget(req.request_id)
        return done

    def get_request_counts(self) -> tuple[int, int]:
        # Parked requests are unfinished: count them as waiting, or the
        # engine loop would go idle with paused work outstanding.
        running, waiting = super().get_request_counts()
        return running, waiting + len(self.held) + len(self.released) + len(self.deferred)

    # --- bookkeeping ------------------------------------------------------
    def _observe(self, outputs, now: float) -> None:
        """The step's new tokens into their readers, read off the outputs
        the clients get: it runs on every step for every request in it."""
        readers = self.readers
        for eco in outputs.values():
            for o in eco.outputs:
                reader = readers.get(o.request_id)
                if reader is None:
                    continue
                if o.new_token_ids:
                    reader.on_tokens(now, len(o.new_token_ids))
                if o.finish_reason is not None:
                    self._forget(o.request_id)
                    if self._standby:  # it ran this step: its slot and KV are free
                        self._freed += 1

    def _count_recompute(self, out) -> None:
        """On a released request's first step back, what it had to recompute:
        KV computed at the pause minus what the cache or host pool restored."""
        for req_id, n in out.num_scheduled_tokens.items():
            at_release = self._computed_at_release.pop(req_id, None)
            if at_release is None:
                continue
            restored = self.requests[req_id].num_computed_tokens - n
            self.tf_stats.resumed_after_release += 1
            self.tf_stats.tokens_recomputed += max(0, at_release - restored)

    def _forget(self, req_id: str) -> None:
        self._computed_at_release.pop(req_id, None)
        self.readers.pop(req_id, None)
        self.table.remove(req_id)
        self.held.pop(req_id, None)
        self.released.pop(req_id, None)
        self.deferred.pop(req_id, None)

    def _measure_step(self, scheduler_output, now: float) -> None:
        """A step ran from when it was scheduled or when the previous step's
        output came in, whichever is later: under async scheduling step N+1
        is scheduled before step N ends, and steps then follow back to back."""
        scheduled = self._scheduled_at.popleft() if self._scheduled_at else None
        last, self._last_output_at = self._last_output_at, now
        if scheduled is None or not scheduler_output.total_num_scheduled_tokens:
            return
        start = scheduled if last is None else max(scheduled, last)
        decode = prefill = 0
        for n in scheduler_output.num_scheduled_tokens.values():
            if n == 1:
                decode += 1
            else:
                prefill += n
        # Requests the runner (re)adds to its batch this step: newcomers,
        # released ones resumed, and any left out of the step before (held
        # ones coming back), for which vLLM sends the whole token list.
        cached = scheduler_output.scheduled_cached_reqs
        back = cached.resumed_req_ids.union(cached.all_token_ids) if cached.all_token_ids else cached.resumed_req_ids
        starts = len(scheduler_output.scheduled_new_reqs) + len(back)
        self.meters.on_step(now - start, decode, prefill, starts)

    # --- the decision -----------------------------------------------------
    def _blocks(self, num_tokens: int) -> int:
        """KV blocks a request of num_tokens needs to take one more step:
        ceil((num_tokens + 1) / block_size)."""
        return (num_tokens + self.block_size) // self.block_size

    def snapshot(self, now: float) -> tuple[RequestColumns, EngineView]:
        """Every live request as the policy's columns, and the engine. It
        runs each interval something contends, over every live request, so
        each column is one pass at C speed: the fixed facts come from the
        request table, the readers' levels from their `dry_at`, the context
        from vLLM's token lists; no object is built per request."""
        readers = self.readers
        groups = [self.running, list(self.held.values()), list(self.released.values()),
                  [r for r in self.waiting if r.status in _QUEUED]]
        reqs = [r for g in groups for r in g]
        ids = list(map(_ID, reqs))
        if not all(map(readers.__contains__, ids)):  # a request without a reader is not the policy's
            groups = [[r for r in g if r.request_id in readers] for g in groups]
            reqs = [r for g in groups for r in g]
            ids = list(map(_ID, reqs))
        n, table, bs = len(ids), self.table, self.block_size
        rows = table.rows(ids)
        counts = list(map(len, groups))
        phase, resident = np.repeat(_GROUP_PHASE, counts), np.repeat(_GROUP_RESIDENT, counts)
        rate = table.rate[rows]
        dry_at = np.fromiter(map(_DRY_AT, map(readers.__getitem__, ids)), dtype=np.float64, count=n)
        num_output = np.fromiter(map(len, map(_OUTPUT, reqs)), dtype=np.int64, count=n)
        num_tokens = table.num_prompt[rows] + num_output
        host_blocks = np.zeros(n, dtype=np.int64)
        if self.host_tier is not None and counts[2]:
            start = counts[0] + counts[1]
            host_blocks[start:start + counts[2]] = [self.host_tier.request_blocks(r.request_id) for r in groups[2]]
        cols = RequestColumns(
            ids=ids, phase=phase, arrival_time=table.arrival_time[rows], rate=rate,
            # ReaderBuffer.level, for all readers at once (none before a first token).
            buffer_tokens=np.maximum(rate * (dry_at - now), 0.0),
            num_output=num_output, max_tokens=table.max_tokens[rows], num_tokens=num_tokens,
            blocks=(num_tokens + bs) // bs, kv_resident=resident, host_blocks=host_blocks,
            reading=dry_at > -np.inf)
        m, tier = self.meters, self.host_tier
        eng = EngineView(
            block_size=self.block_size,
            total_blocks=self.kv_cache_config.num_blocks,
            free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            max_num_seqs=self.max_num_running_reqs,
            decode_tps=m.decode_capacity,
            step_rate=m.step_rate.value,
            prefill_tps=m.prefill_speed,
            start_s=m.start_seconds,
            step_cost=m.decode_step_cost,
            transfer_tps=tier.transfer_tps() if tier is not None else None,
            host_blocks=tier.capacity_blocks() if tier is not None else 0,
            running=len(self.running),
        )
        return cols, eng

    def _buffer_seconds_of(self, req_id: str) -> float:
        reader = self.readers.get(req_id)
        return reader.buffer_seconds(self.clock()) if reader is not None and reader.delivered else 0.0

    def _queue_counts(self) -> QueueCounts:
        """The queues in numbers, without a snapshot of every request."""
        waiting_blocks = sum(self._blocks(r.num_tokens) for r in self.waiting)
        return QueueCounts(len(self.running), len(self.waiting), len(self.held) + len(self.released),
                           waiting_blocks, self.kv_cache_manager.block_pool.get_num_free_blocks(),
                           self.kv_cache_config.num_blocks, self.max_num_running_reqs)

    def _reschedule(self, now: float) -> None:
        self._undefer()  # each decision weighs every waiting request afresh
        if not self.policy.needs_decision(self._queue_counts()):
            return  # nothing contends: vLLM admits every newcomer this step
        t0 = time.perf_counter()
        cols, eng = self.snapshot(now)
        if not len(cols):
            return
        t1 = time.perf_counter()
        decision = self.policy.decide(cols, eng)
        self.tf_stats.decision_seconds += time.perf_counter() - t1
        if self._trace is not None:
            self._trace.record(now, cols, eng, decision, self.policy)
        self._standby, self._freed = decision.standby if decision is not None else [], 0
        if decision is not None:
            self.tf_stats.decisions += 1
            self.tf_stats.fallbacks += decision.fallback_fcfs
            self._apply(decision, now)
        # The whole cost on the step: snapshot, policy and apply.
        self.reschedule_seconds.append((len(cols), time.perf_counter() - t0))

    def _apply(self, d: Decision, now: float) -> None:
        by_id = {r.request_id: r for r in self.running}
        stamp = time.monotonic()
        stats = self.tf_stats
        for req_id in d.pause_hold:
            if req_id in self.held:
                continue  # already held: stays so
            req = by_id.get(req_id)
            if req is None or not self._pausable(req):
                stats.pauses_skipped += 1
                continue
            self.running.remove(req)  # left out of the next batch; KV kept
            self.held[req_id] = req
            stats.pauses_hold += 1
            stats.pauses_in_flight += self._in_flight(req)
        for req_id in d.pause_release:
            if req_id in self.released:
                continue  # already released: stays so
            req = by_id.get(req_id) or self.held.get(req_id)
            if req is None or not self._pausable(req):
                stats.pauses_skipped += 1
                continue  # a held one stays held
            if self.held.pop(req_id, None) is None:
                self.running.remove(req)
            stats.pauses_in_flight += self._in_flight(req)
            self._computed_at_release[req_id] = req.num_computed_tokens
            # vLLM's own preemption: frees the blocks, resets the request to
            # recompute, marks any in-flight output stale, queues it in
            # `waiting` (taken out again: parked until resumed).
            self._preempt_request(req, stamp)
            self.waiting.remove_request(req)
            self.released[req_id] = req
            stats.pauses_release += 1
        if self.host_tier is not None:
            for req_id in d.recompute:  # its next lookup then reports no host hit
                self.host_tier.recompute(req_id)
        self._resume(d.order)
        self._defer(d.defer)

    def _defer(self, req_ids: list[str]) -> None:
        """Take the working set's overflow out of `waiting` (in one pass)."""
        if not req_ids:
            return
        queued = {r.request_id: r for r in self.waiting}
        reqs = [req for i in req_ids if (req := queued.get(i)) is not None]
        if reqs:
            self.waiting.remove_requests(reqs)
            self.deferred.update((req.request_id, req) for req in reqs)

    def _undefer(self) -> None:
        """Deferred requests back to the tail of `waiting`, in arrival order."""
        for req in self.deferred.values():
            self.waiting.add_request(req)
        self.deferred.clear()

    def _idle_while_parked(self) -> bool:
        """Nothing runs, yet parked requests wait: the batch finished before
        the next decision was due (newcomers may be queued behind the KV
        the held keep), so decide now rather than idle until then."""
        return not self.running and bool(self.held or self.released)

    def _fill_freed_slots(self) -> None:
        """Slots freed since the last decision by requests that finished
        go to the decision's standby, in its order, while vLLM's queue is
        empty (what it holds, the decision put first: it takes the freed
        slots and KV). A held request keeps its KV, and a finished one
        freed at least what the next interval's growth asks."""
        room = 0 if self.waiting else min(self._freed, self.max_num_running_reqs - len(self.running))
        self._freed = 0
        if room <= 0:
            return
        left = []
        for req_id in self._standby:
            req = self.held.get(req_id)
            if req is None:
                continue  # resumed, released or finished since
            if room and not self._in_flight(req):  # in flight: its last step's output is not in yet
                self.running.append(self.held.pop(req_id))  # at the tail: the first vLLM preempts
                self.tf_stats.resumes += 1
                room -= 1
            else:
                left.append(req_id)
        self._standby = left

    def _pausable(self, req: Request) -> bool:
        """Running, and past its prompt (a prefill chunk may be in flight
        then; a step of decode in flight is fine, see the module doc)."""
        return req.status == RequestStatus.RUNNING and req.num_output_tokens > 0

    @staticmethod
    def _in_flight(req: Request) -> bool:
        """A step of it is scheduled and its output not in yet (async)."""
        return req.num_in_flight_tokens > 0

    def _resume(self, order: list[str]) -> None:
        """Put the chosen back in `order`: held ones into `running` while
        slots last, released ones and admitted newcomers to the head of
        `waiting` (ahead of those not chosen), in that order."""
        waiting = {r.request_id: r for r in self.waiting}
        held, released = self.held, self.released
        to_queue = []
        self._resume_next = []
        for req_id in order:
            if (req := waiting.get(req_id)) is not None:
                self.waiting.remove_request(req)
                to_queue.append(req)
                continue
            parked = held.get(req_id) or released.get(req_id)
            if parked is None:
                continue
            if self._in_flight(parked):
                # Its last step's output is not in yet; under async
                # scheduling it will be by the next schedule().
                self._resume_next.append(req_id)
                self.tf_stats.resumes_delayed += 1
            elif req_id in held:
                if len(self.running) < self.max_num_running_reqs:
                    self.running.append(held.pop(req_id))
                    self.tf_stats.resumes += 1
            else:
                to_queue.append(released.pop(req_id))
                self.tf_stats.resumes += 1
        # vLLM re-admits from the front of the queue.
        for req in reversed(to_queue):
            self.waiting.prepend_request(req)
        # vLLM preempts from the tail of `running` when blocks run out, so
        # keep the policy's order: its lowest priority goes first (those it
        # did not rank, first of all).
        running = self.running
        rank = dict(zip(order, range(len(order))))
        place = list(map(rank.get, map(_ID, running), repeat(-1)))
        running[:] = [running[i] for i in sorted(range(len(running)), key=place.__getitem__)]

    def scheduler_state(self) -> SchedulerState:
        """What the engine replica reads (router push, metrics)."""
        now = self.clock()
        running = [r for r in self.running if r.request_id in self.readers]
        buffers = [self.readers[r.request_id].buffer_seconds(now) for r in running
                   if self.readers[r.request_id].delivered]
        tier = self.host_tier
        kv = self.kv_cache_manager.block_pool
        parked = (*self.held, *self.released)
        return SchedulerState(
            policy=self.tf_config.policy,
            running=len(self.running),
            waiting=len(self.waiting) + len(self.kv_holding_waiting) + len(self.deferred),
            paused_hold=len(self.held),
            paused_release=len(self.released),
            buffer_s_min=min(buffers, default=None),
            buffer_s_sum=sum(buffers),
            buffer_s=buffers,
            required_rate=sum(self.readers[r.request_id].rate for r in running)
            + sum(self.readers[i].rate for i in parked if i in self.readers),
            decode_tps=self.meters.decode_capacity,
            step_rate=self.meters.step_rate.value,
            peak_step_rate=self.meters.peak_step_rate or None,
            kv_free_blocks=kv.get_num_free_blocks(),
            kv_total_blocks=self.kv_cache_config.num_blocks,
            host_pool_blocks=tier.capacity_blocks() if tier is not None else 0,
            stats=SchedulerStats(**vars(self.tf_stats)),  # a copy: the totals go on changing
            offload=tier.counters() if tier is not None else None,
        )


class TokenFlowScheduler(TokenFlowMixin, Scheduler):
    """For synchronous scheduling (the CPU backend forces it)."""


class TokenFlowAsyncScheduler(TokenFlowMixin, AsyncScheduler):
    """For async scheduling (vLLM's default on GPU)."""
