"""The TokenFlow scheduling policy (paper, "The scheduler"). Pure Python.

Given a snapshot of every live request and of the engine, decide which
requests hold the accelerator for the next interval: which keep running,
which pause (keeping their KV or releasing it), which resume, and which
waiting requests are admitted. The policy owns no engine state; the vLLM
adapter (tokenflow/engine/scheduler.py) builds the snapshot and applies the result.

Steps, as in the paper:
 1. Stress check: act only when paused requests exist, or when vLLM alone
    would leave someone out: the waiting requests do not all fit in the
    free sequence slots and KV blocks (less a growth headroom). Otherwise
    vLLM admits every newcomer in this very step and nothing needs to
    pause, so TokenFlow costs nothing when nothing contends.
 2. Overload fallback: when the readers' required rates (each at most what
    one running request gets) exceed the measured decode capacity, resume
    everything in arrival order (FCFS).
 3. Working set: W_static = floor(M / beta); when few run,
    W_scheduled = W_static - lambda * (W_static - N_running) bounds admission.
 4. Pinning, with a hysteresis made of costs, not tuned levels (`Levels`):
    a paused request must resume once its buffer would not outlast its
    return (reload or recompute, one step) plus the interval to the next
    decision, times mu; a running request may be paused only with a buffer
    above that level by one interval plus the swap's own cost (evict,
    reload, a step out), so every pause lasts at least one interval. Past
    that level it is still guarded from paused readers (a newcomer's first
    token may take its place, a paused reader's resume may not) until it
    has decoded enough that what the swap costs the batch (step 5) stays
    within the share of the engine swaps may take: half its spare capacity,
    the readers' need against what the batch that fits in KV decodes
    (`swap_share`). As the need nears capacity, readers run longer between
    swaps; at capacity no reader is swapped out for another. A reader at
    its resume level may still take a guarded reader's place while the
    swaps so made this interval cost within that share of what the engine
    decodes in an interval (it would stall otherwise). A
    waiting request whose reader has begun (a stream continued from a lost
    engine, or one vLLM preempted) is a released pause: it jumps ahead of
    newcomers only when its buffer nears that level.
 5. Priority: U_i = (useful tokens in the next dt) + gamma * exp(-b_i / r_i).
    The paper writes the penalty as a cost of *pausing*; ranking by the
    value of *running* adds it instead. A running request's U also counts
    the tokens the engine loses to swapping it out and back (the swap's
    extra work holds up the whole batch), so two requests swap only when
    that gains more than it costs (the measured cost of putting a request
    back in the batch, and the recompute the swap adds to it: the whole
    context without a host tier, the unfinished tail block with one; with
    one, also the step and the reload its own slot sits out). Highest U
    runs while KV blocks and sequence slots last; of the rest, the largest
    buffers (in seconds) release KV first. Once the work in hand is known
    (its tokens left over the engine's capacity), readers above their
    resume level (unguarded) rank after newcomers: those who read on past
    that work's end first, longest first; those it can serve just in time
    last (`TokenFlowPolicy.tiers`). Tokens sent ahead of need land past a
    reader's cap and count for nothing in effective throughput.
 6. Resume mode: reload from host when its I/O time is below the prefill
    time of the context, else recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter, itemgetter

from tokenflow.core.buffer import EFFECTIVE_HIGH_FRACTION
from tokenflow.core.config import TokenFlowConfig

# The rank key's first element (step 4 before step 5): requests that must run
# sort first, incumbents before the paused, each by lowest buffer; the rest
# follow by priority U.
KEEP_RUNNING = 0  # running, its buffer at or below the pause level
MUST_RESUME = 1  # paused, its buffer at or below the resume level
GUARDED = 2  # running past the pause level, not yet past the swap's share: ranked by U, but no paused reader's place
BY_PRIORITY = 3
OUTLASTS = 4  # a reader above its resume level who reads on past the work in hand: most reading past it first
SENT_AHEAD = 5  # a reader above its resume level who finishes reading within the work in hand: by U, last
_VALUE, _REQUEST = itemgetter(0), itemgetter(1)  # of a tier's (value, request) pair
_ARRIVAL = attrgetter("arrival_time")


class Phase(str, Enum):
    WAITING = "waiting"  # not admitted yet (new, or released and queued)
    RUNNING = "running"
    PAUSED = "paused"  # parked by us; `kv_resident` says whether it kept its KV


@dataclass(slots=True)  # slots: the policy reads these fields in its hot loop
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
    # Its reader has begun and reads from its buffer while it waits: a
    # stream continued from a lost engine, or one vLLM preempted.
    reading: bool = False

    @property
    def buffer_s(self) -> float:
        return self.buffer_tokens / self.rate


@dataclass
class EngineView:
    block_size: int
    total_blocks: int
    free_blocks: int
    max_num_seqs: int
    decode_tps: float | None = None  # measured aggregate decode tokens/s (capacity)
    step_rate: float | None = None  # measured decode steps/s = tokens/s per request
    prefill_tps: float | None = None  # measured prefill tokens/s
    start_s: float | None = None  # measured step seconds per request (re)added to the batch
    # Measured (s per step, s per decode token) of a decode step: what a
    # batch of k requests decodes per second, k / (base + per_token * k).
    step_cost: tuple[float, float] | None = None
    transfer_tps: float | None = None  # host<->device KV tokens/s; None: no offload
    host_blocks: int = 0  # this engine's share of the host KV pool, in blocks
    running: int = 0  # requests in the batch now (0: not given)


@dataclass
class Decision:
    run: list[str] = field(default_factory=list)  # on the accelerator next interval
    pause_hold: list[str] = field(default_factory=list)  # pause, keep KV
    pause_release: list[str] = field(default_factory=list)  # pause, free KV
    admit: list[str] = field(default_factory=list)  # waiting requests let in now
    # run + admit in the order they get slots and KV: priority order, or
    # arrival order in the FCFS fallback. vLLM re-admits in this order.
    order: list[str] = field(default_factory=list)
    # Waiting requests beyond the working set: kept out of vLLM's queue
    # until the next decision, so a freed slot does not admit them.
    defer: list[str] = field(default_factory=list)
    # Waiting requests not chosen now but within the working set: left in
    # vLLM's queue, which admits them as slots and KV free up.
    wait: list[str] = field(default_factory=list)
    # Released ones resumed by recompute although the host holds their KV:
    # at the measured speeds, prefill beats the transfer. (The others load
    # whatever the host holds: vLLM's connector does it unasked.)
    recompute: list[str] = field(default_factory=list)
    fallback_fcfs: bool = False
    # The share of the engine's decode time that swaps may take this
    # interval: half its spare capacity (see `swap_share`). 0: none.
    swap_share: float = 0.5
    # That share of what the engine decodes in one interval, in tokens:
    # what readers at their resume level may spend this interval on taking
    # guarded readers' places (`TokenFlowPolicy.rank`). 0: nothing.
    swap_budget: float = 0.0
    # Seconds the work in hand (every live request's tokens left) takes at
    # the engine's capacity: a reader whose answer its reader finishes
    # within it is served just in time, not ahead (`TokenFlowPolicy.tiers`).
    # 0: capacity unknown, no reader is told apart so.
    work_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Levels:
    """The measured costs the pause and resume levels are made of."""

    step_rate: float  # decode steps/s (tokens/s one running request gets)
    load_per_token: float  # s per context token to bring released KV back (reload, or recompute)
    swap_per_token: float  # s per context token to release and bring back
    recompute_per_token: float  # s of batch prefill per token recomputed (0 while unmeasured)

    @property
    def step_s(self) -> float:
        """One step: the least a request waits to run again."""
        return 1.0 / self.step_rate

    @classmethod
    def of(cls, eng: EngineView, dt: float) -> "Levels":
        step_rate = eng.step_rate or 1.0 / dt  # unknown yet: one step per interval
        recompute = 1.0 / eng.prefill_tps if eng.prefill_tps else 0.0
        if eng.transfer_tps:  # the host tier: write-back and reload
            load = 1.0 / eng.transfer_tps
            swap = 2.0 / eng.transfer_tps
        else:  # no tier: released KV is recomputed
            load = swap = recompute
        return cls(step_rate, load, swap, recompute)


@dataclass(slots=True)
class Pool:
    """What one pass over the live requests tells the policy."""

    waiting: list[RequestView]  # in the order given
    active: list[RequestView]  # running or paused, in the order given
    required: float  # the active readers' rates, summed
    n_running: int
    blocks: int  # KV blocks of all requests, summed
    active_blocks: int  # KV blocks of the running and paused requests, summed
    waiting_blocks: int  # KV blocks the waiting requests need to start
    tokens_left: int  # output tokens all of them have still to generate


def survey(reqs: list[RequestView], rate_cap: float = math.inf) -> Pool:
    """Split and count the requests in one pass (it runs over every live
    request each interval that has something waiting or paused). A reader
    needs at most `rate_cap` tokens/s (what one running request gets): one
    that states more is served at that speed whatever it states."""
    waiting, active = [], []
    required, n_running, blocks, waiting_blocks, left = 0.0, 0, 0, 0, 0
    waiting_phase, running = Phase.WAITING, Phase.RUNNING  # locals: this loop is hot
    for r in reqs:
        blocks += r.blocks
        left += r.max_tokens - r.num_output
        phase = r.phase
        if phase is waiting_phase:
            waiting.append(r)
            waiting_blocks += r.blocks
            continue
        active.append(r)
        rate = r.rate
        required += rate if rate < rate_cap else rate_cap
        if phase is running:
            n_running += 1
    return Pool(waiting, active, required, n_running, blocks, blocks - waiting_blocks, waiting_blocks, left)


@dataclass(slots=True)
class QueueCounts:
    """The engine's queues in numbers: what the stress check reads."""

    n_running: int
    n_waiting: int
    n_paused: int
    waiting_blocks: int  # KV blocks the waiting requests need to start
    free_blocks: int
    total_blocks: int
    max_num_seqs: int


def headroom_blocks(kv_headroom: float, total_blocks: int) -> int:
    """KV blocks kept free for the running requests' growth."""
    return math.ceil(kv_headroom * total_blocks)


def contended(q: QueueCounts, kv_headroom: float) -> bool:
    """Step 1 (the stress check): someone is paused, or the waiting requests
    do not all fit in the free slots and KV blocks, less the headroom kept
    for the running requests' growth. Cheap on purpose: the adapter asks it
    each interval before it builds any snapshot."""
    if q.n_paused or q.n_running + q.n_waiting > q.max_num_seqs:
        return True
    return q.waiting_blocks + headroom_blocks(kv_headroom, q.total_blocks) > q.free_blocks


# No measure of spare capacity yet: swaps may take half the engine.
DEFAULT_SWAP_SHARE = 0.5


def fitting_capacity(pool: Pool, eng: EngineView, kv_headroom: float) -> float | None:
    """Decode tokens/s the engine gives the active readers: as many of them
    as fit at once (sequence slots, or KV blocks at their mean footprint
    plus a block of growth), at the measured step cost of a batch that
    size. Long answers fill KV long before the slots run out, and then the
    best decode rate seen (short contexts, every slot busy) overstates it."""
    if not pool.active:
        return None
    usable = eng.total_blocks - headroom_blocks(kv_headroom, eng.total_blocks)
    footprint = pool.active_blocks / len(pool.active) + 1
    k = max(1, min(eng.max_num_seqs, int(usable // footprint)))
    if eng.step_cost is not None:
        base, per_token = eng.step_cost
        return k / (base + per_token * k)
    return k * eng.step_rate if eng.step_rate else None


def swap_share(required: float, capacity: float | None) -> float:
    """The share of decode time that swapping readers in and out may take:
    half the spare capacity, 1 - required / capacity. Each swap costs the
    batch a fixed amount of work, so the pause level asks a reader to run
    long enough between swaps to keep within this share. Half, so that what
    the engine delivers stays above what its readers need, with room for
    the estimates' error. At or past capacity the share is 0: no reader
    is swapped out for another, and readers keep the slots they hold, as
    in the paper's FCFS fallback; newcomers still get their first tokens."""
    if not capacity:
        return DEFAULT_SWAP_SHARE
    spare = 1.0 - required / capacity
    return spare / 2 if spare > 0.0 else 0.0


def fcfs_decision(reqs: list[RequestView]) -> Decision:
    """Everyone runs or is admitted in arrival order, paused readers (who
    arrived earlier) before newcomers; vLLM packs memory in that order."""
    d = Decision(fallback_fcfs=True)
    admit, run, order, waiting = d.admit, d.run, d.order, Phase.WAITING
    for r in sorted(reqs, key=_ARRIVAL):
        (admit if r.phase is waiting else run).append(r.req_id)
        order.append(r.req_id)
    return d


class TokenFlowPolicy:
    def __init__(self, cfg: TokenFlowConfig):
        self.cfg = cfg

    def decide(self, reqs: list[RequestView], eng: EngineView) -> Decision | None:
        """None means: no stress, leave vLLM's batch as it is."""
        cfg = self.cfg
        pool = survey(reqs, eng.step_rate or math.inf)
        counts = QueueCounts(pool.n_running, len(pool.waiting), len(pool.active) - pool.n_running,
                             pool.waiting_blocks, eng.free_blocks, eng.total_blocks, eng.max_num_seqs)
        if not self.needs_decision(counts):
            return None
        if eng.decode_tps and pool.required > cfg.overload_factor * eng.decode_tps:
            return fcfs_decision(reqs)
        capacity = fitting_capacity(pool, eng, cfg.kv_headroom)
        share = swap_share(pool.required, capacity)
        budget = share * capacity * cfg.dt if capacity else 0.0
        work_end = pool.tokens_left / capacity if capacity else 0.0
        by_arrival = sorted(pool.waiting, key=_ARRIVAL)
        # The earliest arrivals get the room; the rest are deferred. The
        # working set never defers a newcomer that fits in the free slots and
        # KV now: vLLM alone would admit it this step.
        room = max(self.working_set_room(pool.n_running, len(pool.active), pool.blocks / len(reqs), eng),
                   self.fits_now(by_arrival, pool.n_running, eng))
        newcomers, deferred = by_arrival[:room], by_arrival[room:]
        candidates = pool.active + newcomers
        # sorted() is stable: equal keys keep the order of `candidates`.
        chosen = self.pack(self.rank(candidates, eng, share, budget, work_end), eng)
        d = self.to_decision(pool, chosen, deferred, eng)
        d.swap_share, d.swap_budget, d.work_end_s = share, budget, work_end
        return d

    def needs_decision(self, q: QueueCounts) -> bool:
        return contended(q, self.cfg.kv_headroom)

    # --- pieces -----------------------------------------------------------
    def fits_now(self, by_arrival: list[RequestView], n_running: int, eng: EngineView) -> int:
        """How many of the earliest waiting requests the free sequence slots
        and KV blocks (less the growth headroom) hold as they are."""
        free = eng.free_blocks - headroom_blocks(self.cfg.kv_headroom, eng.total_blocks)
        slots, n = eng.max_num_seqs - n_running, 0
        for r in by_arrival:
            if n >= slots or r.blocks > free:
                break
            free -= r.blocks
            n += 1
        return n

    def working_set_room(self, n_running: int, n_current: int, mean_blocks: float, eng: EngineView) -> int:
        """How many waiting requests may join the working set now (step 3)."""
        cfg = self.cfg
        # beta: the mean footprint of the requests we hold now, plus what one
        # interval of decoding adds to it.
        beta = max(1.0, mean_blocks + (eng.step_rate or 1.0) * cfg.dt / eng.block_size)
        # The working set may exceed device memory: the excess lives in the
        # host pool, or (without offload) is recomputed on resume.
        if eng.transfer_tps:
            memory = eng.total_blocks + eng.host_blocks
        else:
            memory = eng.total_blocks * (1 + cfg.recompute_overcommit)
        w_static = max(1, math.floor(memory / beta))
        w_sched = w_static
        if n_running < eng.max_num_seqs:
            w_sched = w_static - cfg.working_set_lambda * (w_static - n_running)
        # Never fewer than one newcomer when nothing runs, or the engine idles.
        return max(0 if n_running else 1, math.floor(w_sched) - n_current)

    def rank(self, candidates: list[RequestView], eng: EngineView,
             share: float = DEFAULT_SWAP_SHARE, budget: float = 0.0, work_end: float = 0.0) -> list[RequestView]:
        """Steps 4 and 5: requests that must keep running, then those that
        must resume, each lowest buffer first; then the rest by priority U,
        highest first. Guarded running readers rank with the newcomers, by
        U, ahead of every other running or paused request: a paused reader
        at its resume level takes free room or an unguarded reader's place,
        and a guarded one's only while the swaps so made cost the batch at
        most `budget` tokens (the guarded of lowest U first). Those it
        cannot have wait behind the guarded. Readers above their resume
        level come last when the work in hand is known (OUTLASTS, then
        SENT_AHEAD, see tiers()). Sorts are stable: equal keys
        keep the given order."""
        costs: list[float] = []
        keep, resume, guard, rest, outlast, ahead_of_time = self.tiers(candidates, eng, share, costs, work_end)
        keep, resume = (list(map(_REQUEST, sorted(t, key=_VALUE))) for t in (keep, resume))
        last = [*map(_REQUEST, sorted(outlast, key=_VALUE)), *map(_REQUEST, sorted(ahead_of_time, key=_VALUE))]
        if not guard:
            return keep + resume + list(map(_REQUEST, sorted(rest, key=_VALUE))) + last
        waiting = Phase.WAITING
        ahead, others = list(guard), []
        for p in rest:
            (ahead if p[1].phase is waiting and not p[1].reading else others).append(p)
        ahead = list(map(_REQUEST, sorted(ahead, key=_VALUE)))
        room = self.room_beside_guard(keep, resume, guard, costs, budget, eng) if resume else set()
        first = [r for r in resume if id(r) in room]
        later = [r for r in resume if id(r) not in room]
        return keep + first + ahead + later + list(map(_REQUEST, sorted(others, key=_VALUE))) + last

    def room_beside_guard(self, keep: list[RequestView], resume: list[RequestView], guard: list,
                          costs: list[float], budget: float, eng: EngineView) -> set[int]:
        """Which readers at their resume level (as ids) the slots and KV
        hold when the guarded keep theirs, less those whose swaps they may
        buy: a reader about to stall loses what it reads while it waits,
        and the swap's cost comes out of capacity that, below the readers'
        need, would only fill buffers. `budget` bounds that spend per
        interval as the guard bounds each reader's (`swap_share`). The
        guarded of lowest U are given up first, while their swaps fit in
        the budget and some reader at its resume level is still left out."""
        cap, grow, slots = self.pack_limits(eng)
        waiting = Phase.WAITING

        def take(r: RequestView, used: int, n: int) -> tuple[int, int]:
            """pack()'s step: the state after it meets `r`. pack() keeps
            the same step inline (it runs over every candidate each
            decision); a property test holds the two equal."""
            need = r.blocks if r.phase is waiting else r.blocks + grow
            if n >= slots or (used + need > cap and n):
                return used, n
            return used + need, n + 1

        held = sorted(zip(guard, costs), key=lambda g: g[0][0])  # highest U first
        # pack()'s state after the keep and after each prefix of the held,
        # so that giving up the last held reader repacks only the resume.
        used = n = 0
        for r in keep:
            if n >= slots:
                break
            used, n = take(r, used, n)
        states = [(used, n)]
        for (_, r), _ in held:
            if n >= slots:  # full: every longer prefix leaves this state
                break
            used, n = take(r, used, n)
            states.append((used, n))
        m = len(held)
        while True:
            (used, n), room = states[min(m, len(states) - 1)], set()
            for r in resume:
                if n >= slots:  # full: no later reader fits
                    break
                after = take(r, used, n)
                if after[1] > n:
                    room.add(id(r))
                    used, n = after
            if not m or len(room) == len(resume) or held[m - 1][1] > budget:
                return room
            m -= 1
            budget -= held[m][1]

    def tiers(self, reqs: list[RequestView], eng: EngineView, share: float = DEFAULT_SWAP_SHARE,
              costs: list[float] | None = None, work_end: float = 0.0) -> tuple[list, list, list, list, list, list]:
        """Each request as a (value, request) pair in its tier, in the given
        order: KEEP_RUNNING and MUST_RESUME valued by buffer seconds (step 4),
        GUARDED, BY_PRIORITY and SENT_AHEAD by -U (step 5), OUTLASTS by the
        seconds its reader reads on past the work in hand, negated;
        ascending value ranks first. One pass over
        all candidates per decision, so the constants are bound once and the
        clamps are comparisons, not min()/max(). `costs`, if given, gets
        each guarded request's swap cost in tokens, in the guard's order.

        Once the work in hand is known (`work_end` > 0: the seconds every
        live request's tokens left take at the engine's capacity,
        Decision.work_end_s), an unguarded reader above its resume level
        runs only in the room newcomers and readers about to run dry leave.
        Its resume level brings it back before it runs dry, so each token
        it gets now is sent ahead of need, into a buffer that only grows,
        and past the part of the answer worth sending ahead
        (EFFECTIVE_HIGH_FRACTION) a token counts for nothing. When the
        engine decodes more than its readers need, that room must go to
        someone. SENT_AHEAD: its reader finishes the answer (what it holds
        and what is left, at its rate) before the work in hand ends; every
        token it gets early is one it would have counted in full later, so
        it comes last. OUTLASTS: its reader reads on past the end of that
        work; some of its tokens go out ahead of need whatever is chosen,
        the more so the longer it reads on, so the longest reading first."""
        cfg = self.cfg
        dt, mu, gamma, high = cfg.dt, cfg.mu, cfg.gamma, EFFECTIVE_HIGH_FRACTION
        lv = Levels.of(eng, dt)
        step, load, swap, recompute = lv.step_s, lv.load_per_token, lv.swap_per_token, lv.recompute_per_token
        tier, bs = bool(eng.transfer_tps), eng.block_size
        start = eng.start_s or 0.0  # the batch's cost of (re)adding a request, beyond its tokens
        speed_dt = lv.step_rate * dt
        # A swap's extra prefill holds up the whole batch, so it costs what
        # the batch decodes per second now, not one request's speed.
        batch_tps = lv.step_rate * eng.running if eng.running else (eng.decode_tps or lv.step_rate)
        exp, running, paused = math.exp, Phase.RUNNING, Phase.PAUSED
        keep, resume, guard, rest, outlast, last = [], [], [], [], [], []
        for r in reqs:
            rate, b, n, phase = r.rate, r.buffer_tokens, r.num_tokens, r.phase
            if phase is running:
                # Mid-prefill requests never pause: the work done would be
                # lost.
                if not r.num_output:
                    keep.append((b / rate, r))
                    continue
                # The pause level: back in time (released, the worst case)
                # for one more interval, plus the swap's own time.
                resume_level = rate * mu * (n * load + step + dt)
                if b < resume_level + rate * (dt + n * swap + step):
                    keep.append((b / rate, r))
                    continue
                # The tokens the engine loses to this swap, priced as a
                # release (the worst case, as the pause level is): the
                # measured cost of putting a request back in the batch,
                # plus its recompute. Without a host tier the batch
                # recomputes the whole context. With one, the host holds
                # every full block: the batch recomputes the unfinished tail
                # block, and this slot sits out one step plus the reload. A
                # pause itself costs the others no step (docs/BENCHMARKS.md:
                # a whole step charged at the engine's capacity kept
                # newcomers out for seconds; nothing charged swapped
                # near-equal readers every interval).
                if tier:
                    bonus = (((n - 1) % bs) * recompute + start) * batch_tps + (step + n * load) * lv.step_rate
                else:
                    bonus = (n * recompute + start) * batch_tps
                # Guarded from paused readers until it has decoded enough
                # since its resume that this swap's cost stays within the
                # share of the engine swaps may take (the reader decodes
                # about `bonus / share` tokens between resume and pause),
                # but never once its next tokens are of no use now (below).
                guarded = b < resume_level + bonus / share if share > 0.0 else True
            elif phase is paused or r.reading:  # a waiting reader is a released pause
                back = step if r.kv_resident else n * load + step
                if b < rate * mu * (back + dt):  # the resume level
                    resume.append((b / rate, r))
                    continue
                bonus, guarded = 0.0, False
            else:
                bonus, guarded = 0.0, False
            # useful = min(speed_dt, max(0.0, x)), with the builtins' tie rules.
            useful = high * r.max_tokens - b + rate * dt
            if useful > 0.0:
                useful = useful if useful < speed_dt else speed_dt
            else:
                # Its reader holds more than the part of the answer worth
                # sending ahead: no guard. At capacity (share 0) the guard
                # would keep it decoding while readers at their resume
                # level run dry.
                useful, guarded = 0.0, False
            value = -(useful + gamma * exp(-b / rate) + bonus)
            if guarded:
                guard.append((value, r))
                if costs is not None:
                    costs.append(bonus)
            elif work_end > 0.0 and (phase is running or phase is paused or r.reading):
                reads_on = b + r.max_tokens - r.num_output - rate * work_end  # tokens past the work's end
                if reads_on < 0.0:
                    last.append((value, r))
                else:
                    outlast.append((-reads_on / rate, r))
            else:
                rest.append((value, r))
        return keep, resume, guard, rest, outlast, last

    def rank_key(self, r: RequestView, eng: EngineView, share: float = DEFAULT_SWAP_SHARE,
                 work_end: float = 0.0) -> tuple[int, float]:
        """(tier, value) of one request: where rank() puts it."""
        for tier, members in enumerate(self.tiers([r], eng, share, work_end=work_end)):
            if members:
                return tier, members[0][0]
        raise AssertionError("unreachable: every request has a tier")

    def must_run(self, r: RequestView, eng: EngineView, share: float = DEFAULT_SWAP_SHARE) -> bool:
        return self.rank_key(r, eng, share)[0] in (KEEP_RUNNING, MUST_RESUME)

    def priority(self, r: RequestView, eng: EngineView, share: float = DEFAULT_SWAP_SHARE) -> float:
        """U_i: useful tokens in the next dt if run, plus the low-buffer penalty."""
        tier, value = self.rank_key(r, eng, share)
        return -value if tier in (GUARDED, BY_PRIORITY, SENT_AHEAD) else math.inf  # OUTLASTS: not by U

    def pack_limits(self, eng: EngineView) -> tuple[int, int, int]:
        """(KV blocks to fill, blocks a running request grows by in an
        interval, sequence slots): what pack() fills."""
        cap = eng.total_blocks - headroom_blocks(self.cfg.kv_headroom, eng.total_blocks)
        grow = math.ceil((eng.step_rate or 1.0) * self.cfg.dt / eng.block_size)
        return cap, grow, eng.max_num_seqs

    def pack(self, ordered: list[RequestView], eng: EngineView) -> list[RequestView]:
        """Take requests in order while sequence slots and KV blocks last."""
        budget, grow, slots = self.pack_limits(eng)
        waiting = Phase.WAITING
        chosen, used = [], 0
        for r in ordered:
            need = r.blocks if r.phase is waiting else r.blocks + grow
            if used + need > budget and chosen:
                continue
            chosen.append(r)
            used += need
            if len(chosen) >= slots:
                break
        return chosen

    def to_decision(self, pool: Pool, chosen: list[RequestView], deferred: list[RequestView],
                    eng: EngineView) -> Decision:
        d = Decision(defer=[r.req_id for r in deferred])
        waiting = Phase.WAITING
        need = 0  # blocks the chosen must still get on the device
        for r in chosen:  # in priority order: vLLM preempts from the tail
            d.order.append(r.req_id)
            if r.phase is waiting:
                d.admit.append(r.req_id)
                need += r.blocks
                continue
            d.run.append(r.req_id)
            if not r.kv_resident:
                need += r.blocks
                if self.resume_mode(r, eng) == "recompute":
                    d.recompute.append(r.req_id)
        chosen_ids = set(d.run)
        chosen_ids.update(d.admit)
        chosen_ids.update(d.defer)
        # The pool keeps the given order, which the unchosen keep too.
        d.wait = [r.req_id for r in pool.waiting if r.req_id not in chosen_ids]
        losers = [r for r in pool.active if r.req_id not in chosen_ids]
        # Unchosen resident requests free KV only as far as the chosen need
        # it, largest buffers (in seconds of reading) first; the rest pause
        # holding their blocks.
        free = eng.free_blocks
        losers.sort(key=attrgetter("buffer_s"), reverse=True)
        for r in losers:
            if not r.kv_resident:
                d.pause_release.append(r.req_id)  # already released: stays so
            elif free < need:
                d.pause_release.append(r.req_id)
                free += r.blocks
            else:
                d.pause_hold.append(r.req_id)
        return d

    def resume_mode(self, r: RequestView, eng: EngineView) -> str | None:
        """How a released request comes back (step 6): "reload" when moving
        its host blocks beats prefilling its context, else "recompute". None
        when there is nothing to weigh (no transfer measured yet, or nothing
        on the host): vLLM then loads whatever the host holds."""
        if not eng.transfer_tps or r.host_blocks == 0:
            return None
        t_io = r.host_blocks * eng.block_size / eng.transfer_tps
        t_prefill = r.num_tokens / eng.prefill_tps if eng.prefill_tps else math.inf
        return "reload" if t_io < t_prefill else "recompute"
