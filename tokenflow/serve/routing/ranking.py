"""Which engine takes the next request: ranking by buffer slack.

Pure Python (no Ray, no vLLM): the ingress request routers and the tests use
it as is.

Slack of an engine is measured in reader-seconds over a horizon H: how much
reading time it can still give newcomers before one of its readers stalls.

    slack = H * (capacity - required) / reader_rate      spare decode rate, as readers
          + sum over running streams of min(b_i, r_i H) / reader_rate
                                                          buffers TokenFlow can lend

`required` is the sum of its readers' stated rates (running and waiting),
plus `reader_rate` per non-streaming request; b_i is a reader's buffer in
tokens and r_i its rate (each rate at most one stream's speed there): what
it has in hand spares the engine that many of the tokens it needs over H,
so a reader with H seconds of text in hand needs nothing over H, however
slowly it reads. `capacity` is the best decode
rate the engine has shown, or `capacity_tps` when it has not shown more yet.
An idle engine thus has the most slack; an engine whose readers are all
near empty buffers has little, even at the same request count. Negative
slack is a deficit: its readers will stall unless work moves elsewhere.

Each request goes to the engine with the most slack left after the
requests just sent to it: every request sent since the engine's last pushed
state counts as the load it will add once a push shows it (its stated rate,
at most one stream's speed there, over H), so the ranking is the same before
and after that push.
A burst therefore fills engines by slack instead of herding onto one: it
goes first where slack is largest, until what is left is level; a burst
that uses up the slack is split in proportion to it; beyond that, evenly.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from pydantic import Field

from tokenflow.core.config import DEFAULT_RATE
from tokenflow.core.settings import Count, Positive, Settings


class RoutingSettings(Settings):
    """The `router:` block of the app args (configs/*.yaml)."""

    block = "router"

    enabled: bool = Field(True, description="Route by buffer slack; false: Serve's default power-of-two-choices "
                                            "router.")
    push_interval_s: Positive = Field(0.1, description="How often (s) each engine may push its state: at such a "
                                      "tick when a count or its slack has moved enough to matter, else every "
                                      "stale_after_s / 2.")
    stale_after_s: Positive = Field(0.3, description="State older than this (s) is stale: with a fresh peer, "
                                                     "that engine is still ranked by its last state and the "
                                                     "requests sent since until its state is twice this old, "
                                                     "then skipped (a dead or hung engine stops pushing; Serve's "
                                                     "health checks then replace it). No fresh engine at all: "
                                                     "Serve's default routing.")
    refresh_interval_s: Positive = Field(0.05, description="Least time (s) between two long polls of the state "
                                                           "board by one ingress (each is answered on the next "
                                                           "push): at most one snapshot per this interval reaches "
                                                           "an ingress, however many engines push, and a row waits "
                                                           "in it at most this long before a newer one comes. Half "
                                                           "the push interval: at 1,000 engines it kept the state "
                                                           "age at decision under 250 ms (docs/SCALING.md).")
    horizon_s: Positive = Field(10.0, description="How far ahead (s) slack looks (H).")
    capacity_tps: Positive = Field(1000.0, description="Decode tokens/s assumed for an engine until it shows "
                                                       "more.")
    reader_rate: Positive | None = Field(None, description="Tokens/s of one new reader; null: the tokenflow "
                                                           "block's default_rate.")
    board_shards: Count = Field(1, description="State boards per app: engines push to one of them by a hash of "
                                               "their id, and each ingress long-polls all of them. One board "
                                               "takes every push of its engines (push rate x engines); see "
                                               "docs/SCALING.md for when to add boards.")
    node_relay: bool = Field(False, description="Engines push to one relay actor on their node, which forwards "
                                                "their states to the boards in one message per board and "
                                                "relay_interval_s (relay.py). For many engines per node or many "
                                                "nodes: a board's cost is per message.")
    relay_interval_s: Positive = Field(0.1, description="Least time (s) between two messages of a node's relay to "
                                                        "one board; what arrives meanwhile goes in the next. The "
                                                        "push interval: each engine's state goes in the next "
                                                        "message, and a board takes one message per node per push "
                                                        "interval (docs/SCALING.md).")
    head_size: Count = Field(64, description="Engines the state boards name per long poll, all boards together "
                                             "(each its share, rounded up): those with the most slack, or all of "
                                             "them when there are no more. Bounds what an ingress reads and ranks "
                                             "per poll and per request however large the cluster; a burst from "
                                             "one ingress between two polls spreads over at most this many "
                                             "engines.")
    rebalance: bool = Field(False, description="An engine that holds paused streams moves some to less loaded "
                                               "engines with spare rate (rebalance.py), continued there by the "
                                               "ingress; streams that cannot be continued, or ask to stay, stay. "
                                               "Off by default: on 2 CPU cores it raised effective throughput "
                                               "but also the readers' total stall (docs/BENCHMARKS.md); measure "
                                               "with `tokenflow bench-rebalance` first.")
    rebalance_interval_s: Positive = Field(1.0, description="Least time (s) between two rounds of moves by one "
                                                            "engine (the peers' pushes show the last round by then).")
    rebalance_min_buffer_s: Positive = Field(0.5, description="A stream moves only while its reader has at least "
                                                              "this many seconds of text left: the time for its "
                                                              "first token on the other engine (a push, a long "
                                                              "poll and a prefill).")
    pending_ttl_s: Positive = Field(2.0, description="A sent request that no push ever reflects stops counting "
                                                     "after this (s).")

    @property
    def rate(self) -> float:
        return self.reader_rate if self.reader_rate is not None else DEFAULT_RATE


@dataclass
class EngineState:
    """What one engine replica pushes about itself (see tokenflow/serve/streams.py)."""

    engine_id: str  # Serve replica unique id, as the request router sees it
    node_id: str = ""
    replica: str = ""  # full replica name, for people reading /v1/tokenflow/engines
    pid: int = 0  # the replica's process on its node, for operators
    running: int = 0  # streams that got their first token
    waiting: int = 0  # streams with no token yet
    unary: int = 0  # non-streaming requests in flight
    stalled: int = 0  # running streams whose reader has nothing buffered
    buffer_s_sum: float = 0.0  # sum of running readers' buffered seconds
    buffered_capped: float = 0.0  # their buffered tokens, each at most what its reader reads over the horizon
    buffer_s_min: float | None = None
    rate_sum: float = 0.0  # tokens/s the streams' readers need, each at most `stream_tps`
    stream_tps: float | None = None  # most tokens/s one stream gets here (the best step rate); None: not measured
    decode_tps: float = 0.0  # tokens/s delivered lately
    peak_tps: float = 0.0  # best decode_tps seen: a capacity estimate
    received_total: int = 0  # requests ever received (settles "just sent" counts)
    slots: int | None = None  # requests its engine runs at once (vLLM's max_num_seqs); None: not known
    seq: int = 0
    sent_at: float = 0.0  # engine wall clock at push (the state board counts transit from it)
    scheduler: dict | None = None  # the TokenFlow scheduler's own summary, when available

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.unary

    def to_dict(self) -> dict:
        # Shallow (not dataclasses.asdict, which deep-copies `scheduler`):
        # built on every push, and pickled right after.
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineState":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def slack(state: EngineState, s: RoutingSettings, peer_tps: float = 0.0) -> float:
    """peer_tps: the best decode rate its peers (replicas of the same
    deployment, so alike) have shown. A restarted or new engine has shown
    nothing yet; judged by capacity_tps alone it would look poorer than a
    busy twin and never get work."""
    capacity = max(state.peak_tps, peer_tps, s.capacity_tps)
    required = state.rate_sum + state.unary * s.rate
    spare_readers = (capacity - required) / s.rate
    return s.horizon_s * spare_readers + state.buffered_capped / s.rate


def peer_tps(states) -> float:
    """The best decode rate any of these engines has shown (see slack)."""
    return max((st.peak_tps for st in states), default=0.0)


def engine_terms(state: EngineState, s: RoutingSettings, best_tps: float) -> tuple[float, float, float, int]:
    """What ranking needs of one engine's state, computed once per state:
    (slack, reader-seconds one token/s of a sent reader's rate takes from
    it, the most a sent reader's rate counts there, load)."""
    # A sent request will show as one more reader: its rate over H, counted
    # as the engine will count it (at most one stream's speed), so an engine
    # that has reported its share of a burst and one whose share is still in
    # flight weigh the same, whatever rates its readers state.
    cap = state.stream_tps if state.stream_tps and state.stream_tps > 0 else math.inf
    return slack(state, s, best_tps), s.horizon_s / s.rate, cap, state.load


NOTHING_SENT = (0, 0.0)


def left_after(term: tuple[float, float, float, int], sent: tuple[int, float]) -> tuple[float, int]:
    """(slack left, load) of an engine (its engine_terms) after the requests
    sent to it (`sent`: how many, and their rates summed, each at most the
    engine's cap)."""
    base, per_rate, _, load = term
    count, rates = sent
    return base - per_rate * rates, load + count


def order_engines(terms: dict[str, tuple[float, float, float, int]],
                  pending: dict[str, tuple[int, float]]) -> list[str]:
    """Engine ids, best first: most slack left after the requests sent to
    each (`pending`, per engine as left_after takes it); ties: least
    loaded, then by id so the order is deterministic."""

    def key(eid: str):
        slack_left, load = left_after(terms[eid], pending.get(eid, NOTHING_SENT))
        return (-slack_left, load, eid)

    return sorted(terms, key=key)


def rank_engines(states: dict[str, EngineState], pending: dict[str, list[float]], s: RoutingSettings) -> list[str]:
    """Engine ids, best first, for the next request (`pending`: the stated
    rates of the requests sent to each since its state). Callers pass only
    fresh states."""
    best = peer_tps(states.values())
    terms = {eid: engine_terms(st, s, best) for eid, st in states.items()}
    sent = {eid: (len(rates), sum(min(r, terms[eid][2]) for r in rates)) for eid, rates in pending.items()}
    return order_engines(terms, sent)


def split_burst(states: dict[str, EngineState], n: int, s: RoutingSettings,
                rates: list[float] | None = None) -> dict[str, int]:
    """Where n requests sent before any new push would go (for tests and
    docs); `rates`: each one's stated rate (default s.rate)."""
    pending: dict[str, list[float]] = {e: [] for e in states}
    for i in range(n):
        pending[rank_engines(states, pending, s)[0]].append(rates[i] if rates else s.rate)
    return {e: len(v) for e, v in pending.items()}


class CandidateIndex:
    """Serve's candidate replicas by id. Serve passes choose_replicas the
    same list object until its replicas change (then a new list), so the map
    is built once per change, not over every replica on every request."""

    def __init__(self):
        self._list = None
        self._by_id: dict = {}

    def __call__(self, candidates) -> dict:
        if candidates is not self._list or len(self._by_id) != len(candidates):
            self._list = candidates
            self._by_id = {r.replica_id.unique_id: r for r in candidates}
        return self._by_id


class LatencyStats:
    """Recent samples (seconds) and their summary in ms; appends are thread-safe."""

    def __init__(self, keep: int = 4096):
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0

    def add(self, x: float) -> None:
        self.samples.append(x)
        self.count += 1

    def summary(self) -> dict:
        xs = sorted(self.samples)
        if not xs:
            return {"count": self.count}

        def q(p: float) -> float:
            return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 4)

        return {"count": self.count, "mean_ms": round(1000 * sum(xs) / len(xs), 4),
                "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(1000 * xs[-1], 4)}


# A table keeps its last CHOICES_KEPT choices, each with its best
# CHOICE_RANKS engines (view()'s "choices").
CHOICES_KEPT, CHOICE_RANKS = 256, 4


class RoutingTable:
    """One ingress's cached copy of every engine's state, plus what it just sent.

    Written by a refresher (update) and read by choose_replicas (rank) on the
    router's event loop; the HTTP handler reads view() from another thread,
    hence whole-dict swaps and a small lock around `pending`."""

    def __init__(self, settings: RoutingSettings, clock=time.monotonic):
        self.settings = settings
        self._clock = clock
        self._states: dict[str, EngineState] = {}
        self._born: dict[str, float] = {}  # local clock time at which each state was fresh
        self._parts: dict[int, tuple[dict, dict]] = {}  # (states, born) as each state board last said
        self._terms: dict[str, tuple[float, float, float, int]] = {}  # engine_terms of each state, for rank()
        # Per engine, the sends no push reflects yet: (sent at, the rate it
        # counts at there), and those rates summed, so that ranking reads a
        # sum however many a burst sent since the last push.
        self._pending: dict[str, deque] = {}
        self._pending_rate: dict[str, float] = {}
        self._dead: set[str] = set()  # engines Serve saw die (drop())
        self._lock = threading.Lock()
        self.latency = LatencyStats()  # time inside choose_replicas
        self.state_age = LatencyStats()  # age of the chosen engine's state at decision
        self.fallbacks = 0  # decisions left to Serve's default (no fresh state)
        self.decisions: dict[str, int] = {}
        # The last choices, each as (when, the best engines then with the
        # slack each had left and its load): how a burst came to be split.
        self.choices: deque = deque(maxlen=CHOICES_KEPT)
        self.has_read = False  # whether any snapshot of the board has arrived

    def update(self, snapshot: dict[str, tuple[dict, float]], part: int = 0, now: float | None = None) -> None:
        """snapshot: engine_id -> (state dict, age in seconds when read), from
        state board number `part` (it replaces what that board said before)."""
        now = self._clock() if now is None else now
        states, born = {}, {}
        with self._lock:
            for eid, (d, age) in snapshot.items():
                if eid in self._dead:
                    continue
                st = d if isinstance(d, EngineState) else EngineState.from_dict(d)
                old = self._states.get(eid)
                if old is not None and st.received_total > old.received_total:
                    # The engine now counts that many more arrivals: they are
                    # (mostly) ours, so stop counting as many of our sends.
                    for _ in range(min(len(self._pending.get(eid) or ()), st.received_total - old.received_total)):
                        self._pop_sent(eid)
                states[eid], born[eid] = st, now - age
            self._parts[part] = (states, born)
            if len(self._parts) > 1:
                states, born = {}, {}
                for part_states, part_born in self._parts.values():
                    states.update(part_states)
                    born.update(part_born)
            best = peer_tps(states.values())
            self._terms = {eid: engine_terms(st, self.settings, best) for eid, st in states.items()}
            self._states, self._born = states, born
            self.has_read = True

    def drop(self, engine_id: str) -> None:
        """Forget an engine known to be dead. Its last pushes may still sit in
        the state board for a while; a restarted replica has a new id."""
        with self._lock:
            self._dead.add(engine_id)
            states, born = dict(self._states), dict(self._born)
            states.pop(engine_id, None)
            born.pop(engine_id, None)
            self._states, self._born = states, born
            # Copies, never in place: view() may be reading the old dicts.
            self._parts = {p: ({e: v for e, v in ps.items() if e != engine_id},
                               {e: v for e, v in pb.items() if e != engine_id})
                           for p, (ps, pb) in self._parts.items()}
            self._pending.pop(engine_id, None)
            self._pending_rate.pop(engine_id, None)

    def _pop_sent(self, eid: str, latest: bool = False) -> float:
        """Forget the oldest send to `eid` (or the latest); its rate (under the lock)."""
        q = self._pending[eid]
        _, rate = q.pop() if latest else q.popleft()
        # Exactly zero once none is left: no rounding drift over a long life.
        self._pending_rate[eid] = self._pending_rate[eid] - rate if q else 0.0
        return rate

    def on_sent(self, engine_id: str, now: float | None = None, rate: float | None = None) -> None:
        """A request went to `engine_id`; `rate`: the reader's rate its body
        states (None: the default reader's), counted at most at one
        stream's speed there, as the engine's next push will count it."""
        rate = self.settings.rate if rate is None else rate
        terms = self._terms.get(engine_id)
        if terms is not None and rate > terms[2]:
            rate = terms[2]
        entry = (self._clock() if now is None else now, rate)
        with self._lock:
            self._pending.setdefault(engine_id, deque()).append(entry)
            self._pending_rate[engine_id] = self._pending_rate.get(engine_id, 0.0) + rate

    def withdraw(self, engine_id: str) -> float | None:
        """Take back the latest send to `engine_id` (the request went
        elsewhere); its rate, or None when none is pending there."""
        with self._lock:
            return self._pop_sent(engine_id, latest=True) if self._pending.get(engine_id) else None

    def pending_sent(self, now: float | None = None, engines=None) -> dict[str, tuple[int, float]]:
        """Per engine (or each of `engines`): how many requests sent to it no
        push has reflected yet, less those older than pending_ttl_s, and
        the rates they count at, summed."""
        now = self._clock() if now is None else now
        cutoff = now - self.settings.pending_ttl_s
        out = {}
        with self._lock:
            for eid in self._pending if engines is None else engines:
                q = self._pending.get(eid)
                while q and q[0][0] < cutoff:
                    self._pop_sent(eid)
                if q:
                    out[eid] = (len(q), self._pending_rate[eid])
        return out

    def pending(self, now: float | None = None, engines=None) -> dict[str, int]:
        """How many requests sent to each engine no push has reflected yet."""
        return {e: n for e, (n, _) in self.pending_sent(now, engines).items()}

    def queue_len(self, engine_id: str, now: float | None = None) -> int:
        """Requests the engine holds, as its last state and our sends since say."""
        st = self._states.get(engine_id)
        return (st.load if st is not None else 0) + self.pending(now, (engine_id,)).get(engine_id, 0)

    def age(self, engine_id: str, now: float | None = None) -> float | None:
        born = self._born.get(engine_id)
        if born is None:
            return None
        return (self._clock() if now is None else now) - born

    def serving_engines(self, max_age: float, now: float | None = None) -> int:
        """Engines whose state is at most max_age old (dead ones are dropped)."""
        now = self._clock() if now is None else now
        return sum(now - born <= max_age for born in self._born.values())

    def rank(self, candidates, now: float | None = None) -> list[str] | None:
        """Candidates with a fresh state, and those whose state is late by at
        most another stale_after_s, best first; None when none is fresh.
        A busy engine's push can be late (its replica's event loop is taking
        in a burst just then): skipping it would send the rest of the burst
        to its twin. Ranked by its last state plus the requests sent to it
        since, it gets its share; a dead one stays out once its state is
        twice stale_after_s old, and Serve drops it sooner when it sees it die."""
        now = self._clock() if now is None else now
        born, limit = self._born, self.settings.stale_after_s
        # Over the table (at most shards x head_size engines), not over
        # Serve's candidates (every replica of the deployment).
        ages = {e: now - t for e, t in born.items() if e in candidates}
        if not any(age <= limit for age in ages.values()):
            return None
        terms = self._terms
        usable = {e: terms[e] for e, age in ages.items() if age <= 2 * limit and e in terms}
        sent = self.pending_sent(now, usable)
        order = order_engines(usable, sent)
        best = [(e, *left_after(terms[e], sent.get(e, NOTHING_SENT))) for e in order[:CHOICE_RANKS]]
        self.choices.append((round(now, 4), [(e, round(slack_left, 1), load) for e, slack_left, load in best]))
        return order

    def record(self, seconds: float, chosen: str | None, now: float | None = None) -> None:
        self.latency.add(seconds)
        if chosen is None:
            self.fallbacks += 1
            return
        self.decisions[chosen] = self.decisions.get(chosen, 0) + 1
        age = self.age(chosen, now)
        if age is not None:
            self.state_age.add(age)

    def view(self, now: float | None = None) -> dict:
        now = self._clock() if now is None else now
        pending = self.pending(now)
        engines = []
        best = peer_tps(self._states.values())
        for eid, st in sorted(self._states.items()):
            age = now - self._born[eid]
            engines.append({**st.to_dict(), "age_s": round(age, 4),
                            "fresh": age <= self.settings.stale_after_s,
                            "slack_s": round(slack(st, self.settings, best), 3),
                            "pending": pending.get(eid, 0),
                            "routed": self.decisions.get(eid, 0)})
        return {"engines": engines, "fallbacks": self.fallbacks,
                "choices": [{"t": t, "ranked": [list(r) for r in ranked]} for t, ranked in list(self.choices)],
                "routing_latency": self.latency.summary(),
                "state_age_at_decision": self.state_age.summary()}
