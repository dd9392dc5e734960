"""The cluster side of one engine replica: push state, register with the node's KV pool.

Runs as asyncio tasks on the replica's event loop. State pushes are
fire-and-forget (`.remote()`, never awaited); the KV pool loop and the poll
of the TokenFlow scheduler's own summary (an EngineCore utility call) await
their replies but run apart from the pushes. No request ever waits on any.

The pushed state is the replica's stream tracker (exact counts and rates;
buffers from the chunks it sends) plus, when fresh, the scheduler's summary:
its decode capacity estimate, queue and pause counts, KV blocks; its offload
counters go to the node's KV pool.

With `router.rebalance`, a third loop moves paused streams to less loaded
engines with spare rate (rebalance.py); it reads the boards only while
this engine holds paused streams that may move.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict

import ray

from tokenflow.core.sched_state import SchedulerState
from tokenflow.serve import kv_pool
from tokenflow.serve.routing import rebalance
from tokenflow.serve.routing.board import get_board, shard_of
from tokenflow.serve.routing.ranking import EngineState, RoutingSettings, slack
from tokenflow.serve.routing.relay import get_relay
from tokenflow.serve.streams import EngineTracker

logger = logging.getLogger("ray.serve")

SCHEDULER_POLL_S = 0.5  # least interval between reads of the scheduler's summary
# The state's counts that the routers must see as soon as they change
# (EngineAgent._worth_pushing): what each request and each engine's size add.
PUSH_AT_ONCE = ("running", "waiting", "unary", "stalled", "received_total", "slots")
# A quiet engine (no request open, none opened and no token sent since the
# last read) has nothing new for the scheduler poll, the KV pool report or
# the metrics sample: each is then made only this often (the pool takes a
# report as a sign of life within its engine_ttl_s, 30 s by default).
QUIET_REFRESH_S = 2.0
# Least time (s) between two checks that the pushes reach the router's board
# (a dead board is then looked up again, i.e. recreated, this much later at most).
PUSH_CHECK_S = 1.0


class EngineAgent:
    def __init__(self, tracker: EngineTracker, router: RoutingSettings, kv: kv_pool.KVPoolSettings,
                 *, app_name: str, engine_id: str, replica: str = "", scheduler_state=None, metrics=None,
                 engine_dead=None, stopping=None):
        self.tracker = tracker
        self.router_settings = router
        self.kv_settings = kv
        self.app_name = app_name
        self.engine_id = engine_id
        self.replica = replica
        self.node_id = ray.get_runtime_context().get_node_id()
        self.seq = 0
        self._router = None
        self._pool = None
        self._last_push = None  # the latest push's ObjectRef, not yet checked
        self._push_checked_at = -1e9
        self._last_pushed: tuple | None = None  # (its counts, its slack, when) of the last state pushed
        self._tasks: list[asyncio.Task] = []
        # async () -> SchedulerState | None: the TokenFlow scheduler's state
        self._scheduler_state = scheduler_state
        self.sched: SchedulerState | None = None
        self._sched_at = -1e9
        # tokenflow.serve.metrics.EngineMetrics, or None: sampled every METRICS_INTERVAL_S
        self.metrics = metrics
        # () -> bool: whether the replica's EngineCore has died
        self._engine_dead = engine_dead or (lambda: False)
        # () -> bool: whether Serve has begun to stop the replica
        self._stopping = stopping or (lambda: False)
        self._left = False  # said so once
        self._boards: list | None = None  # the app's state boards, read to rebalance
        # Per loop: the tracker's (requests, tokens) totals and the time when it last ran for real.
        self._last_run: dict[str, tuple[tuple[int, int], float]] = {}

    def start(self) -> None:
        # Two loops, so a slow pool registration (its actor may need a new
        # worker process) never delays the state pushes.
        loop = asyncio.get_running_loop()
        if self.router_settings.enabled:
            self._tasks.append(loop.create_task(
                self._loop("push", self._push, self.router_settings.push_interval_s)))
        if self.kv_settings.enabled:
            self._tasks.append(loop.create_task(
                self._loop("kv pool", self._report, self.kv_settings.report_interval_s)))
        if self.router_settings.enabled and self.router_settings.rebalance:
            self._tasks.append(loop.create_task(
                self._loop("rebalance", self._rebalance, self.router_settings.rebalance_interval_s)))
        if self._scheduler_state is not None:
            self._tasks.append(loop.create_task(
                self._loop("scheduler poll", self._poll, self.poll_interval_s, give_up_after=10)))
        if self.metrics is not None:
            from tokenflow.serve.metrics import METRICS_INTERVAL_S

            self._tasks.append(loop.create_task(self._loop("metrics", self._sample, METRICS_INTERVAL_S)))

    @property
    def poll_interval_s(self) -> float:
        """How often the scheduler's summary is read (an EngineCore utility
        call, which the engine loop answers between steps). Routing ranks by
        the stream tracker's state, pushed every push interval; from the
        summary it takes only the decode capacity, which moves slowly, and
        the metrics sample it once per METRICS_INTERVAL_S."""
        return max(self.router_settings.push_interval_s, SCHEDULER_POLL_S)

    def _fresh_sched(self) -> SchedulerState | None:
        # Older than a few polls: the EngineCore is busy or stuck; go without.
        return self.sched if time.monotonic() - self._sched_at < 3 * self.poll_interval_s else None

    def state(self, count: bool = True) -> EngineState:
        """This engine's state now; `count`: as a push (its seq advances)."""
        self.seq += count
        sched = self._fresh_sched()
        # What one stream can get here at any load (SchedulerState.peak_step_rate);
        # it moves slowly: the last one read serves even when not fresh. None
        # until the engine has settled on one: not the step rate now, which a
        # few cold steps or a crowded batch hold far below it, so that every
        # reader sent here would weigh next to nothing and a burst would herd
        # here (docs/BENCHMARKS.md).
        cap = self.sched.peak_step_rate if self.sched is not None else None
        st = EngineState(engine_id=self.engine_id, node_id=self.node_id, replica=self.replica, pid=os.getpid(),
                         seq=self.seq, sent_at=time.time(), stream_tps=cap, **self.tracker.state(rate_cap=cap))
        if sched is not None:
            # The scheduler's decode meter knows the engine's capacity better
            # than the rate this replica happened to deliver.
            st.peak_tps = max(st.peak_tps, float(sched.decode_tps or 0.0))
        return st

    def kv_counters(self) -> dict:
        """Usage and transfer counters for the node pool, from the scheduler's
        view of the host KV tier (tokenflow/kv_offload/); empty without one."""
        sched = self._fresh_sched()
        if sched is None:
            return {}
        out = asdict(sched.offload) if sched.offload is not None else {}
        out["host_pool_blocks"] = sched.host_pool_blocks
        return out

    def _quiet(self, loop: str) -> bool:
        """Whether `loop` may skip this round: nothing has happened on this
        engine since it last ran (no request open, none opened, no token
        sent) and that was under QUIET_REFRESH_S ago. Else it runs, and this
        round is noted as its last."""
        t = self.tracker
        totals, now = (t.received_total, t.tokens_total), time.monotonic()
        last = self._last_run.get(loop)
        if last is not None and last[0] == totals and not t.open_requests and now - last[1] < QUIET_REFRESH_S:
            return True
        self._last_run[loop] = (totals, now)
        return False

    async def _poll(self) -> bool:
        if self._quiet("scheduler poll") and self.sched is not None:
            # Without a request the scheduler takes no step: its summary is
            # as read, and still fresh.
            self._sched_at = time.monotonic()
            return True
        self.sched = await asyncio.wait_for(self._scheduler_state(), timeout=2.0)
        self._sched_at = time.monotonic()
        return self.sched is not None  # None: not a TokenFlow scheduler, nothing to poll

    async def _sample(self) -> None:
        if not self._quiet("metrics"):  # quiet: every gauge and counter stands as sampled
            self.sample_now()

    def sample_now(self) -> None:
        """Gauges, buffer occupancy, tokens sent and the scheduler's counters, for Prometheus."""
        now = self.tracker.clock()
        self.metrics.sample_streams(self.tracker.running_buffers(now), self.tracker.state(now),
                                    self.tracker.tokens_total)
        self.metrics.sample_scheduler(self._fresh_sched())

    def _check_last_push(self, now: float) -> None:
        # A push we never awaited may have failed because the actor is gone
        # for good (e.g. killed): then look it up again (recreating it).
        # Checked at most once per PUSH_CHECK_S: each check (ray.wait) cost
        # a busy replica about a quarter of a push (docs/BENCHMARKS.md), and
        # the latest push tells as well as all of them whether the actor lives.
        ref = self._last_push
        if ref is None or now - self._push_checked_at < PUSH_CHECK_S:
            return
        self._last_push, self._push_checked_at = None, now
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                self._router = None

    async def _push(self) -> bool | None:
        self._check_last_push(time.monotonic())  # first: it may drop the board's handle
        if self._router is None:
            s = self.router_settings
            if s.node_relay:  # the node's relay forwards to the boards; same push and forget calls
                self._router = await asyncio.to_thread(get_relay, self.app_name, self.node_id, s)
            else:
                self._router = await asyncio.to_thread(get_board, self.app_name,
                                                       shard_of(self.engine_id, s.board_shards), s)
        if self._engine_dead():
            # Leave the slack routing at once (an idle dead engine would look
            # like the most slack), and stay out until Serve replaces us.
            logger.error(f"TokenFlow engine {self.engine_id}: its EngineCore died; leaving the routing")
            await self._router.forget.remote(self.engine_id)
            return False
        if self._stopping():
            # Our streams are being handed over: their continuations, and new
            # requests, must go to the other engines.
            if not self._left:
                logger.info(f"TokenFlow engine {self.engine_id}: Serve is stopping this replica; leaving the routing")
                self._left = True
            await self._router.forget.remote(self.engine_id)
            return False
        state = self.state()
        if not self._worth_pushing(state, time.monotonic()):
            return None
        sched = self._fresh_sched()
        if sched is not None:  # for people and the benches: built only for a state that goes out
            state.scheduler = sched.router_summary()
        self._last_push = self._router.push.remote(state.to_dict())

    def _worth_pushing(self, st: EngineState, now: float) -> bool:
        """Whether the routers must see this state now. Each push costs a
        Ray call here and on the board, and wakes every ingress's long poll
        (about a millisecond of CPU each on a small host), so a state goes
        out when a router would act on it:
        - a count changed (a request came or went, a reader stalled);
        - its slack moved by half a reader of the router's rate over the
          horizon or more: the router weighs each request it sends as one
          such reader, so a smaller drift cannot move a burst's split by a
          request (buffers growing in a steady stream move it slowly);
        - half the staleness bound passed since the last push, so the
          state never reaches a router stale (at half the pushes of a busy
          engine when nothing changes).
        Fields only people read (the scheduler's summary) go out with the
        next push."""
        s = self.router_settings
        counts = tuple(getattr(st, k) for k in PUSH_AT_ONCE)
        level = slack(st, s)
        last = self._last_pushed
        if (last is not None and counts == last[0] and abs(level - last[1]) < s.horizon_s / 2
                and now - last[2] < s.stale_after_s / 2):
            return False
        self._last_pushed = (counts, level, now)
        return True

    async def _rebalance(self) -> None:
        """One round of rebalance.py: move paused streams to less loaded
        engines with room."""
        if self._stopping() or self._engine_dead():
            return
        s = self.router_settings
        now = self.tracker.clock()
        idle = [rebalance.Idle(h, r.rate, r.buffer_seconds(now))
                for h, r in self.tracker.idle_movable(now, rebalance.QUIET_S)]
        if not idle:
            return
        own = self.state(count=False)
        if self._boards is None:
            self._boards = [await asyncio.to_thread(get_board, self.app_name, shard, s)
                            for shard in range(s.board_shards)]
        peers = []
        for part in await asyncio.wait_for(asyncio.gather(*(b.wait_snapshot.remote(-1, 0.0) for b in self._boards)),
                                           timeout=2.0):
            peers += [EngineState.from_dict(d) for eid, (d, age) in part[1].items()
                      if eid != self.engine_id and age <= s.stale_after_s]
        moves = rebalance.plan_moves(own, peers, idle, s)
        moved = sum(self.tracker.move(h, to) for h, to in moves)
        if moved:
            logger.info(f"TokenFlow engine {self.engine_id}: {own.load} requests, {len(idle)} paused and "
                        f"movable: moved {moved} to engines with room")

    async def _report(self) -> None:
        if self._pool is None:
            self._pool = await asyncio.to_thread(kv_pool.get_node_pool, self.node_id, self.kv_settings)
            ref = self._pool.register_engine.remote(self.engine_id)
            quota = await asyncio.wait_for(ref, timeout=30)
            logger.info(f"TokenFlow engine {self.engine_id}: host KV quota {quota} bytes on node {self.node_id}")
        elif not self._quiet("kv pool"):
            # Awaited (this loop is not the push loop), so an unreachable
            # pool counts as a failure of this loop.
            await asyncio.wait_for(self._pool.report.remote(self.engine_id, self.kv_counters()), timeout=30)

    async def _loop(self, what: str, step, interval: float, give_up_after: int | None = None) -> None:
        failures = 0
        while True:
            try:
                if await step() is False:
                    return
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the agent die: the engine must keep serving
                failures += 1
                if what == "push":
                    self._router = None
                elif what == "rebalance":
                    self._boards = None
                elif what == "kv pool":
                    self._pool = None
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning(f"TokenFlow engine {self.engine_id}: {what} failed ({failures}x): {e!r}")
                if give_up_after is not None and failures >= give_up_after:
                    return
            await asyncio.sleep(interval)

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.metrics is not None:
            try:
                self.sample_now()  # the counters' last increase
            except Exception:
                pass
        try:
            if self._router is not None:
                self._router.forget.remote(self.engine_id)
            if self._pool is not None:
                self._pool.unregister_engine.remote(self.engine_id)
        except Exception:
            pass
