"""`tokenflow bench-router`: the slack router at cluster scale, on one machine.

Runs the real state boards (tokenflow/serve/routing/board.py) and the real
long-poll, ranking and choosing code of an ingress (board.follow,
ranking.RoutingTable, the steps of request_router.choose_replicas) against
N stand-in engines and M stand-in ingresses, for each N asked.

A stand-in engine has a decode capacity; streams arrive when an ingress
routes one to it, decode at a share of that capacity and end; their readers'
buffers fill and drain. Each engine pushes its state (the real EngineState,
with a scheduler summary of the real size) to its board every push
interval, one actor call per engine as a replica's agent does, spread over
the interval. Many engines live in one process (a Fleet actor).

A stand-in ingress follows every board as a request router does, and routes
a Poisson stream of requests: per request it builds the candidate map over
all N replicas as choose_replicas does, ranks, counts the send, and tells
the chosen engine's fleet, which adds the stream. After the measured window
it routes as fast as it can for a while: decisions per second per ingress.

Choice quality: when a stream arrives, its fleet compares the engine's
slack at that moment with the best slack among the fleet's engines (a
random sample of the cluster): the gap, in readers of the horizon, and the
engine's percentile (100: the most slack).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pickle
import random
import sys
import time
from bisect import bisect_right
from pathlib import Path
from types import SimpleNamespace

STEP_TPS = 60.0  # tokens/s one stream gets when its engine is not full (a decode step rate)
RATE_MIX = ((4.0, 0.3), (10.0, 0.4), (20.0, 0.3))  # readers' tokens/s, and their shares
LENGTH = (100, 600)  # tokens per answer, uniform
TICKS_PER_PUSH = 10  # an engine pushes at one of this many phases of the push interval
FLEET_NICE = 10  # the stand-in engines' CPU priority below the routing parts measured
ARRIVALS_FLUSH_S = 0.05  # routed requests reach their stand-in engines in batches this often
CAPACITY_DECISIONS = 2000  # decisions timed back to back, for decisions/s per ingress


def _scheduler_summary() -> dict:
    """A TokenFlow scheduler's router summary, so rows weigh what real ones do."""
    from tokenflow.core.sched_state import SchedulerState, SchedulerStats

    st = SchedulerState(policy="tokenflow", running=12, waiting=3, paused_hold=2, paused_release=1,
                        buffer_s_min=0.8, buffer_s_sum=41.5, buffer_s=[], required_rate=130.0, decode_tps=3200.0,
                        step_rate=58.0, peak_step_rate=90.0, kv_free_blocks=1200, kv_total_blocks=4096, host_pool_blocks=8192,
                        stats=SchedulerStats(decisions=4321, pauses_hold=120, resumes=118, decision_seconds=1.25),
                        offload=None)
    return st.router_summary()


class SimEngines:
    """Stand-in engines, all of a fleet's in numpy arrays so that thousands
    cost this machine little: each has a decode capacity; each stream a
    reader rate, buffered tokens and tokens left."""

    def __init__(self, ids: list[str], rng: random.Random, capacity_per_engine: int = 256):
        import numpy as np

        self.np = np
        self.ids = ids
        n = len(ids)
        self.capacity = np.array([rng.uniform(1500.0, 4500.0) for _ in ids])
        self.peak = np.zeros(n)
        self.received = np.zeros(n, dtype=np.int64)
        self.seq = np.zeros(n, dtype=np.int64)
        size = n * capacity_per_engine
        self.eng = np.zeros(size, dtype=np.int64)
        self.rate = np.ones(size)
        self.buf = np.zeros(size)
        self.left = np.zeros(size)
        self.alive = np.zeros(size, dtype=bool)
        self.rng = np.random.default_rng(rng.randrange(2 ** 32))
        rates, weights = zip(*RATE_MIX)
        self._rates, self._weights = np.array(rates), np.array(weights) / sum(weights)

    def add(self, engines, buffered=None) -> None:
        np = self.np
        engines = np.asarray(engines, dtype=np.int64)
        slots = np.flatnonzero(~self.alive)[:len(engines)]
        engines = engines[:len(slots)]  # a full table drops the rest (never near it here)
        self.eng[slots] = engines
        self.rate[slots] = self.rng.choice(self._rates, size=len(slots), p=self._weights)
        self.buf[slots] = 0.0 if buffered is None else buffered[:len(slots)]
        self.left[slots] = self.rng.integers(LENGTH[0], LENGTH[1] + 1, size=len(slots))
        self.alive[slots] = True
        np.add.at(self.received, engines, 1)

    def advance(self, group, dt: float) -> list[dict]:
        """Advance the engines of `group` (indices) by dt; their states, as
        EngineState field dicts (without the id-independent fields)."""
        np = self.np
        n = len(self.ids)
        in_group = np.zeros(n, dtype=bool)
        in_group[group] = True
        live = np.flatnonzero(self.alive & in_group[self.eng])
        eng = self.eng[live]
        count = np.bincount(eng, minlength=n)
        per = np.minimum(STEP_TPS, self.capacity / np.maximum(count, 1))
        got = np.minimum(per[eng] * dt, self.left[live])
        rate = self.rate[live]
        buf = np.maximum(0.0, self.buf[live] + got - rate * dt)
        self.buf[live] = buf
        self.left[live] -= got
        self.alive[live[self.left[live] <= 0]] = False
        decode = per * count
        self.peak = np.maximum(self.peak, np.where(in_group, decode, 0.0))
        secs = buf / rate
        sums = np.bincount(eng, weights=secs, minlength=n)
        capped = np.bincount(eng, weights=np.minimum(buf, np.minimum(rate, per[eng]) * 10.0), minlength=n)
        stalled = np.bincount(eng, weights=(buf <= 0), minlength=n)
        rate_sum = np.bincount(eng, weights=np.minimum(rate, per[eng]), minlength=n)
        low = np.full(n, np.inf)
        np.minimum.at(low, eng, secs)
        self.seq[group] += 1
        return [{"running": int(count[i]), "stalled": int(stalled[i]), "buffer_s_sum": float(sums[i]),
                 "buffered_capped": float(capped[i]),
                 "buffer_s_min": float(low[i]) if count[i] else None, "rate_sum": float(rate_sum[i]),
                 "stream_tps": float(per[i]), "decode_tps": float(decode[i]), "peak_tps": float(self.peak[i]),
                 "received_total": int(self.received[i]), "seq": int(self.seq[i])} for i in group]


class Fleet:
    """Many stand-in engines in one process, each pushing to its board, or
    to its node's relay (the real relay body, relay.py, in this process:
    the engine-to-relay hop on a node is not measured here)."""

    def __init__(self, app: str, ids: list[str], settings: dict, seed: int, engines_per_node: int):
        from tokenflow.serve.routing import board
        from tokenflow.serve.routing.ranking import EngineState, RoutingSettings
        from tokenflow.serve.routing.relay import Relay

        self.s = RoutingSettings.from_dict(settings)
        # Below the boards and ingresses: in a cluster the engines and each
        # node's relay run on their own nodes' CPUs, not beside the board.
        os.nice(FLEET_NICE)
        rng = random.Random(seed)
        self.ids = ids
        self.index = {eid: i for i, eid in enumerate(ids)}
        self.sim = SimEngines(ids, rng)
        self.boards = [board.get_board(app, i, self.s) for i in range(self.s.board_shards)]
        if self.s.node_relay:
            relays = [Relay(board.shard_of(f"node-{ids[i]}", self.s.board_shards), self._send,
                            self.s.relay_interval_s) for i in range(0, len(ids), engines_per_node)]
            self.relays = relays
            self.push_of = [relays[i // engines_per_node].push for i in range(len(ids))]
        else:
            self.relays = []
            self.push_of = [self.boards[board.shard_of(eid, self.s.board_shards)].push.remote for eid in ids]
        # A cluster already at work: 0-10 streams each, some tokens buffered.
        starts = [i for i in range(len(ids)) for _ in range(rng.randint(0, 10))]
        self.sim.add(starts, buffered=[rng.uniform(0, 200) for _ in starts])
        # Each row as a real engine's: the fields the sim does not move, once.
        self.template = EngineState(engine_id="", node_id="sim", replica="sim", pid=0,
                                    scheduler=_scheduler_summary()).to_dict()
        self.state_type = EngineState
        self.slack = [0.0] * len(ids)
        self.sorted_slack: list[float] = []
        self.window = (0.0, 0.0)
        self.gaps: list[float] = []  # (best slack - chosen slack) / horizon, per arrival in the window
        self.percentiles: list[float] = []
        self.pushes = 0
        self.relay_wait: list[float] = []  # seconds from a state's making to its relay's send, in the window

    async def _send(self, shard: int, states: list[dict]) -> None:
        now = time.time()
        if self.window[0] <= now <= self.window[1]:
            self.relay_wait.extend(now - st["sent_at"] for st in states)
        await self.boards[shard].push_many.remote(states)

    def _counts(self) -> tuple[int, int]:
        """(states pushed, messages sent to the boards) so far."""
        if self.relays:
            return self.pushes, sum(r.messages for r in self.relays)
        return self.pushes, self.pushes

    async def run(self, start: float, window: tuple[float, float], until: float) -> dict:
        from tokenflow.serve.routing.ranking import slack

        self.window = window
        interval = self.s.push_interval_s
        phases = [list(range(i, len(self.ids), TICKS_PER_PUSH)) for i in range(TICKS_PER_PUSH)]
        await asyncio.sleep(max(0.0, start - time.time()))
        tick = 0
        at_start = at_end = None  # (process CPU, states, messages) at the window's edges
        while time.time() < until:
            began = time.monotonic()
            now = time.time()
            if at_start is None and now >= window[0]:
                at_start = (time.process_time(), *self._counts())
            if at_end is None and now >= window[1]:
                at_end = (time.process_time(), *self._counts())
            group = phases[tick % TICKS_PER_PUSH]
            for i, fields in zip(group, self.sim.advance(group, interval)):
                state = {**self.template, **fields, "engine_id": self.ids[i], "sent_at": time.time()}
                self.push_of[i](state)
                self.pushes += 1
                self.slack[i] = slack(self.state_type(**state), self.s)
            self.sorted_slack = sorted(self.slack)
            tick += 1
            await asyncio.sleep(max(0.0, interval / TICKS_PER_PUSH - (time.monotonic() - began)))
        at_end = at_end or (time.process_time(), *self._counts())
        at_start = at_start or at_end
        return {"cpu_s": at_end[0] - at_start[0], "states": at_end[1] - at_start[1],
                "messages": at_end[2] - at_start[2], "gaps": self.gaps, "percentiles": self.percentiles,
                "relay_wait": self.relay_wait}

    def arrive(self, ids: list[str]) -> None:
        now = time.time()
        measure = self.window[0] <= now <= self.window[1] and self.sorted_slack
        engines = [self.index[eid] for eid in ids]
        if measure:
            for i in engines:
                mine = self.slack[i]
                self.gaps.append((self.sorted_slack[-1] - mine) / self.s.horizon_s)
                self.percentiles.append(100.0 * bisect_right(self.sorted_slack, mine) / len(self.sorted_slack))
        self.sim.add(engines)


class Ingress:
    """One ingress's request router: the real table, long polls and choice."""

    def __init__(self, app: str, ids: list[str], fleet_of: dict[str, int], fleets: list, settings: dict,
                 rate: float, seed: int):
        from tokenflow.serve.routing.ranking import CandidateIndex, LatencyStats, RoutingSettings, RoutingTable

        self.app = app
        self.candidates = CandidateIndex()
        self.choose_cpu = LatencyStats()
        self.s = RoutingSettings.from_dict(settings)
        self.table = RoutingTable(self.s)
        # What Serve hands choose_replicas: every replica of the deployment.
        self.replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=eid)) for eid in ids]
        self.ids = ids
        self.fleet_of, self.fleets = fleet_of, fleets
        self.rate = rate
        self.rng = random.Random(seed)
        self.snapshots = 0
        self.bytes = 0
        self.sampled = 0
        self.arrived: dict[str, float] = {}  # when each engine's row last came in a snapshot (table clock)
        self.since_answer: list[float] = []  # per decision: seconds since the chosen row came, in the window

    def _on_snapshot(self, snap: dict, part: int) -> None:
        self.table.update(snap, part)
        now = time.monotonic()  # the table's clock
        for eid in snap:
            self.arrived[eid] = now
        self.snapshots += 1
        if self.snapshots % 4 == 1:  # measure a quarter of them: pickling costs too
            self.bytes += len(pickle.dumps(snap))
            self.sampled += 1

    def choose(self) -> str:
        """choose_replicas' work for one request (request_router.py), then on_send_request's."""

        start, cpu = time.perf_counter(), time.thread_time()
        by_id = self.candidates(self.replicas)
        order = self.table.rank(by_id)
        if order is None:  # no fresh state: Serve's default would choose
            chosen = self.rng.choice(self.ids)
            self.table.record(time.perf_counter() - start, None)
        else:
            chosen = order[0]
            ranks = [[by_id[e]] for e in order]  # noqa: F841 (what Serve gets back)
            self.table.record(time.perf_counter() - start, chosen)
            self.since_answer.append(time.monotonic() - self.arrived.get(chosen, time.monotonic()))
        self.table.on_sent(chosen)
        self.choose_cpu.add(time.thread_time() - cpu)  # without the time other processes took the core
        return chosen

    async def run(self, start: float, window: tuple[float, float]) -> dict:
        from tokenflow.serve.routing import board
        from tokenflow.serve.routing.ranking import LatencyStats

        followers = [asyncio.get_running_loop().create_task(board.follow(self.app, i, self.s, self._on_snapshot))
                     for i in range(self.s.board_shards)]
        await asyncio.sleep(max(0.0, start - time.time()))
        batches: dict[int, list[str]] = {}
        offered = made = 0
        measuring = False
        snap0 = bytes0 = sampled0 = 0
        cpu0 = 0.0
        due = flush_at = time.time()
        while time.time() < window[1]:
            now = time.time()
            if not measuring and now >= window[0]:
                measuring = True
                self.table.latency, self.table.state_age = LatencyStats(), LatencyStats()
                self.choose_cpu = LatencyStats()
                self.table.fallbacks = 0
                self.since_answer = []
                snap0, bytes0, sampled0, cpu0 = self.snapshots, self.bytes, self.sampled, time.process_time()
            while due <= now:  # Poisson arrivals that are due
                due += self.rng.expovariate(self.rate)
                offered += measuring
                eid = self.choose()
                made += measuring
                batches.setdefault(self.fleet_of[eid], []).append(eid)
            if now >= flush_at:  # one message per fleet per flush: the bench's own traffic stays small
                for f, ids in batches.items():
                    self.fleets[f].arrive.remote(ids)
                batches, flush_at = {}, now + ARRIVALS_FLUSH_S
            await asyncio.sleep(0.005)
        cpu = time.process_time() - cpu0
        elapsed = window[1] - window[0]
        row = {"decisions": made, "fallbacks": self.table.fallbacks,
               "choose_ms": self.table.latency.summary(), "age_ms": self.table.state_age.summary(),
               "choose_cpu_ms": self.choose_cpu.summary(),
               "snapshots_per_s": (self.snapshots - snap0) / elapsed,
               "bytes_per_snapshot": (self.bytes - bytes0) / max(1, self.sampled - sampled0),
               "cpu_util": cpu / elapsed, "table_rows": len(self.table._states),
               "since_answer": list(self.since_answer)}
        row["bytes_per_s"] = row["bytes_per_snapshot"] * row["snapshots_per_s"]
        # Back to back: how many decisions one ingress could make per second.
        t0 = time.perf_counter()
        for _ in range(CAPACITY_DECISIONS):
            self.choose()
        row["max_decisions_per_s"] = CAPACITY_DECISIONS / (time.perf_counter() - t0)
        for f in followers:
            f.cancel()
        return row


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run_one(n: int, *, ingresses: int, per_engine_rate: float, seconds: float, warmup: float, shards: int,
            head_size: int, push_interval: float, fleets: int, seed: int, relay: bool = False,
            engines_per_node: int = 8, refresh_interval: float | None = None,
            relay_interval: float | None = None) -> dict:
    import ray

    from tokenflow.serve.routing import board
    from tokenflow.serve.routing.ranking import RoutingSettings

    app = f"bench-router-{n}-{shards}-{head_size}-{int(relay)}-{os.getpid()}"
    # The router's defaults, as fractions of the push interval.
    refresh = push_interval / 2 if refresh_interval is None else refresh_interval
    relay_gap = push_interval if relay_interval is None else relay_interval
    settings = RoutingSettings(push_interval_s=push_interval, refresh_interval_s=refresh, relay_interval_s=relay_gap,
                               board_shards=shards, head_size=head_size, node_relay=relay).to_dict()
    ids = [f"engine-{i:05d}" for i in range(n)]
    fleets = max(1, min(fleets, n))
    # Whole nodes per fleet (a node's engines share its relay).
    nodes = [ids[i:i + engines_per_node] for i in range(0, n, engines_per_node)]
    chunks = [[eid for node in nodes[f::fleets] for eid in node] for f in range(fleets)]
    chunks = [c for c in chunks if c]
    fleet_of = {eid: i for i, chunk in enumerate(chunks) for eid in chunk}
    s = RoutingSettings.from_dict(settings)
    boards = [board.get_board(app, i, s) for i in range(shards)]
    ray.get([b.stats.remote() for b in boards])
    FleetActor = ray.remote(num_cpus=0)(Fleet)
    IngressActor = ray.remote(num_cpus=0)(Ingress)
    fleet_actors = [FleetActor.remote(app, chunk, settings, seed + i, engines_per_node)
                    for i, chunk in enumerate(chunks)]
    rate = n * per_engine_rate / ingresses
    ingress_actors = [IngressActor.remote(app, ids, fleet_of, fleet_actors, settings, rate, seed + 100 + i)
                      for i in range(ingresses)]
    ray.get([f.__ray_ready__.remote() for f in fleet_actors + ingress_actors])
    start = time.time() + 1.0
    window = (start + warmup, start + warmup + seconds)
    fleet_refs = [f.run.remote(start, window, window[1] + CAPACITY_DECISIONS * 1e-3 + 1.0) for f in fleet_actors]
    ingress_refs = [i.run.remote(start, window) for i in ingress_actors]
    time.sleep(max(0.0, window[0] - time.time()))
    before = ray.get([b.stats.remote() for b in boards])
    time.sleep(max(0.0, window[1] - time.time()))
    after = ray.get([b.stats.remote() for b in boards])
    ins = ray.get(ingress_refs)
    fls = ray.get(fleet_refs)
    for a in fleet_actors + ingress_actors:
        ray.kill(a)
    board.kill_app_actors(app)

    pushes = sum(a["pushes"] - b["pushes"] for a, b in zip(after, before)) / seconds
    messages = sum(a["messages"] - b["messages"] for a, b in zip(after, before)) / seconds
    board_cpu = [(a["cpu_s"] - b["cpu_s"]) / seconds for a, b in zip(after, before)]
    gaps = [g for f in fls for g in f["gaps"]]
    waits = [w for f in fls for w in f["relay_wait"]]
    since = [x for i in ins for x in i["since_answer"]]
    pcts = [p for f in fls for p in f["percentiles"]]
    choose = [i["choose_ms"] for i in ins]
    age = [i["age_ms"] for i in ins]
    offered_pushes = n / push_interval
    row = {
        "engines": n, "ingresses": ingresses, "board_shards": shards, "head_size": head_size,
        "node_relay": relay, "engines_per_node": engines_per_node if relay else None,
        "requests_per_s": round(n * per_engine_rate, 1),
        "pushes_offered_per_s": round(offered_pushes, 1),
        "pushes_sent_per_s": round(sum(f["states"] for f in fls) / seconds, 1),
        "pushes_handled_per_s": round(pushes, 1),
        "messages_sent_per_s": round(sum(f["messages"] for f in fls) / seconds, 1),
        "messages_handled_per_s": round(messages, 1),
        "board_cpu_util_max": round(max(board_cpu), 3),
        "age_p50_ms": max(a.get("p50_ms", 0) for a in age), "age_p99_ms": max(a.get("p99_ms", 0) for a in age),
        "choose_p50_ms": max(c.get("p50_ms", 0) for c in choose),
        "choose_p99_ms": max(c.get("p99_ms", 0) for c in choose),
        "choose_cpu_p99_ms": max(i["choose_cpu_ms"].get("p99_ms", 0) for i in ins),
        "max_decisions_per_s": round(min(i["max_decisions_per_s"] for i in ins)),
        "decisions": sum(i["decisions"] for i in ins), "fallbacks": sum(i["fallbacks"] for i in ins),
        "bytes_per_s_per_ingress": round(max(i["bytes_per_s"] for i in ins)),
        "rows_per_ingress": max(i["table_rows"] for i in ins),
        "ingress_cpu_util_max": round(max(i["cpu_util"] for i in ins), 3),
        "fleet_cpu_util": round(sum(f["cpu_s"] for f in fls) / seconds, 3),
        # Where a state's age at decision goes: waiting in its node's relay
        # (relays only), and in the ingress's table since the poll answer
        # that brought it (the rest: the board and the hops to it).
        "relay_wait_p50_ms": _ms(_pct(waits, 0.5)), "relay_wait_p99_ms": _ms(_pct(waits, 0.99)),
        "since_answer_p50_ms": _ms(_pct(since, 0.5)), "since_answer_p99_ms": _ms(_pct(since, 0.99)),
        "slack_gap_readers_p50": _round(_pct(gaps, 0.5)), "slack_gap_readers_p99": _round(_pct(gaps, 0.99)),
        "slack_percentile_mean": _round(sum(pcts) / len(pcts) if pcts else None),
    }
    # Saturated: the board took clearly fewer pushes than were sent to it,
    # or its process was busy nearly all the time.
    # Saturated: the boards took clearly fewer messages than were sent (a
    # relay replaces an unsent state by a newer one, so states may differ),
    # or the busiest one was busy nearly all the time.
    row["board_saturated"] = messages < 0.9 * row["messages_sent_per_s"] or max(board_cpu) > 0.9
    row["board_ms_per_message"] = round(1000 * sum(board_cpu) / messages, 3) if messages else None
    return row


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


COLUMNS = (("engines", "engines"), ("board_shards", "boards"), ("head_size", "head"), ("node_relay", "relay"),
           ("pushes_offered_per_s", "states/s offered"), ("pushes_handled_per_s", "states/s handled"),
           ("messages_handled_per_s", "messages/s handled"), ("board_cpu_util_max", "board CPU"),
           ("age_p50_ms", "age P50 ms"), ("age_p99_ms", "age P99 ms"),
           ("choose_p50_ms", "choose P50 ms"), ("choose_p99_ms", "choose P99 ms"),
           ("choose_cpu_p99_ms", "choose CPU P99 ms"),
           ("max_decisions_per_s", "decisions/s max"), ("bytes_per_s_per_ingress", "bytes/s per ingress"),
           ("slack_gap_readers_p50", "gap P50 (readers)"), ("slack_gap_readers_p99", "gap P99 (readers)"),
           ("slack_percentile_mean", "chosen pct"), ("board_saturated", "saturated"))


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["board_shards"], r["head_size"], r["node_relay"]), []).append(r)
    for (shards, head, relay), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["engines"])
        xs = [r["engines"] for r in rs]
        label = f"{shards} board(s), head {head}" + (", node relays" if relay else "")

        def routed(r: dict, key: str) -> float:
            # No state reached the ingresses in time: every decision was
            # Serve's default; nothing of the slack routing to plot.
            return float("nan") if r["fallbacks"] >= r["decisions"] else r[key]

        axes[0].plot(xs, [routed(r, "age_p99_ms") for r in rs], marker="o", label=label)
        axes[1].plot(xs, [routed(r, "choose_p99_ms") for r in rs], marker="o", label=label)
        axes[2].plot(xs, [r["board_cpu_util_max"] for r in rs], marker="o", label=label)
    for ax, title, limit in ((axes[0], "state age at decision, P99 (ms)", 250),
                             (axes[1], "time to choose, P99 (ms)", 1.0),
                             (axes[2], "busiest board's CPU (cores)", None)):
        ax.set_xscale("log")
        ax.set(xlabel="engines", title=title)
        if limit is not None:
            ax.axhline(limit, color="grey", linestyle="--", linewidth=1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser) -> None:
    parser.add_argument("--engines", default="2,10,100,1000", help="comma-separated engine counts")
    parser.add_argument("--shards", default="1", help="comma-separated state board counts to try at each size")
    parser.add_argument("--head-size", default="64", help="comma-separated head sizes to try at each size")
    parser.add_argument("--relay", default="on", choices=("on", "off", "both"),
                        help="engines push through their node's relay (router.node_relay), or each to a board")
    parser.add_argument("--engines-per-node", type=int, default=8)
    parser.add_argument("--ingresses", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s per engine, all ingresses together")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--push-interval", type=float, default=0.1)
    parser.add_argument("--refresh-interval", type=float, default=None,
                        help="least time (s) between an ingress's long polls of a board (default: half the push interval)")
    parser.add_argument("--relay-interval", type=float, default=None,
                        help="least time (s) between two messages of a node's relay (default: the push interval)")
    parser.add_argument("--fleets", type=int, default=2, help="processes the stand-in engines live in")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", default="out/bench-router")


def _ints(text: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated whole numbers, got {text!r}") from None
    if not xs or min(xs) < 1:
        raise ValueError(f"--{what} must name at least one number, each at least 1")
    return xs


def run(args) -> int:
    try:
        sizes = _ints(args.engines, "engines")
        shard_list = _ints(args.shards, "shards")
        heads = _ints(args.head_size, "head-size")
        for name in ("ingresses", "fleets", "engines_per_node"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("rate", "seconds", "push_interval") + tuple(
                n for n in ("refresh_interval", "relay_interval") if getattr(args, n) is not None):
            if not getattr(args, name) > 0 or math.isinf(getattr(args, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
        if args.warmup < 0:
            raise ValueError("--warmup must not be negative")
    except ValueError as e:
        print(f"tokenflow bench-router: error: {e}", file=sys.stderr)
        return 2

    import ray
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    relays = {"on": [True], "off": [False], "both": [False, True]}[args.relay]
    plan = [(n, sh, h, rl) for n in sizes for sh in shard_list for h in heads for rl in relays]
    # A Ray instance of its own (not one `ray start` or a test session left running).
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    try:
        bar = tqdm(plan, desc="bench-router", unit="run", file=sys.stderr, dynamic_ncols=True)
        for n, shards, head, relay in bar:
            bar.set_postfix(engines=n, boards=shards, head=head, relay=relay, refresh=True)
            row = run_one(n, ingresses=args.ingresses, per_engine_rate=args.rate, seconds=args.seconds,
                          warmup=args.warmup, shards=shards, head_size=head, push_interval=args.push_interval,
                          fleets=args.fleets, seed=args.seed, relay=relay, engines_per_node=args.engines_per_node,
                          refresh_interval=args.refresh_interval, relay_interval=args.relay_interval)
            rows.append(row)
            tqdm.write(json.dumps(row), file=sys.stderr)
    finally:
        ray.shutdown()
    summary = {"machine": {"cpus": os.cpu_count()}, "args": {k: v for k, v in vars(args).items() if k != "func"},
               "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.no_plots:
        print(f"wrote {plot(rows, out / 'router_scale.png')}")
    print(table(rows))
    print(f"wrote {out}/summary.json")
    return 0
