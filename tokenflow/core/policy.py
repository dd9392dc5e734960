"""The TokenFlow scheduling policy (paper, "The scheduler"). Pure Python and
numpy: it decides over every live request at once, as columns
(tokenflow/core/columns.py), so a decision costs a few dozen array
operations whatever the number of requests.

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
 2. Overload fallback, off unless `overload_factor` is set: when the
    readers' required rates (each at most what one running request gets)
    exceed that share of the measured decode capacity, run in arrival order
    (FCFS): the earliest arrivals, paused readers included, take the slots
    and KV, later ones pause for them. Off by default: at or past capacity
    the swap share (step 4) is already 0, so a reader is swapped out for
    another only once its own next tokens count for less, and on vLLM's
    loop with a known capacity the fallback lost first tokens and
    effective throughput at every load past it that was tried
    (docs/BENCHMARKS.md, "The overload fallback, on a known capacity").
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
    the readers' need (newcomers' included) against what the batch that
    fits in KV decodes (`swap_share`). As the need nears capacity, readers
    run longer between swaps. At capacity, where that share is 0, a reader
    keeps its slot against readers at their resume level while its next
    interval counts for as much as theirs would, less the swap's cost; and
    there someone's reader waits whatever is chosen, so a newcomer, whose
    reader has nothing yet, must run as a reader with an empty buffer,
    ahead of every reader with something left to read. A reader at
    its resume level may still take a guarded reader's place while the
    swaps so made this interval cost within that share of what the engine
    decodes in an interval (it would stall otherwise). A
    waiting request whose reader has begun (a stream continued from a lost
    engine, or one vLLM preempted) is a released pause: it jumps ahead of
    newcomers only when its buffer nears that level.
 5. Priority: U_i = (useful tokens in the next dt) + gamma * exp(-b_i / r_i),
    the useful tokens weighed as effective throughput weighs them.
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
from operator import itemgetter

import numpy as np

from tokenflow.core.buffer import interval_worth
from tokenflow.core.columns import PAUSED, RUNNING, WAITING, Phase, RequestColumns, RequestView
from tokenflow.core.config import TokenFlowConfig

__all__ = ["Decision", "EngineView", "Phase", "QueueCounts", "RequestColumns", "RequestView", "TokenFlowPolicy"]

# The rank key's first element (step 4 before step 5): requests that must run
# sort first, incumbents before the paused, each by lowest buffer; the rest
# follow by priority U.
KEEP_RUNNING = 0  # running, its buffer at or below the pause level
MUST_RESUME = 1  # paused, its buffer at or below the resume level
GUARDED = 2  # running past the pause level, not yet past the swap's share: ranked by U, but no paused reader's place
BY_PRIORITY = 3
OUTLASTS = 4  # a reader above its resume level who reads on past the work in hand: most reading past it first
SENT_AHEAD = 5  # a reader above its resume level who finishes reading within the work in hand: by U, last


def _columns(reqs: RequestColumns | list[RequestView]) -> RequestColumns:
    return reqs if isinstance(reqs, RequestColumns) else RequestColumns.of(reqs)


def _in_order(*keys: np.ndarray) -> np.ndarray:
    """Positions sorted by the first key, then the next...: a stable sort
    (np.lexsort takes its primary key last and keeps ties in place)."""
    return np.lexsort(keys[::-1])


def _pick(ids: list[str], rows: np.ndarray) -> list[str]:
    """The ids of `rows`, in their order."""
    rows = rows.tolist()
    return list(itemgetter(*rows)(ids)) if len(rows) > 1 else [ids[i] for i in rows]


def _sum(x: np.ndarray) -> float:
    """Summed in order, as a loop would (numpy's sum pairs terms: another
    rounding, and a comparison at the edge could flip)."""
    return float(np.cumsum(x)[-1]) if len(x) else 0.0


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
    # pause_hold in rank order: a slot that frees before the next decision
    # (a request finished) goes to the first of them not yet back. They
    # hold their KV, so running them costs no reload, and the batch does
    # not shrink while they wait.
    standby: list[str] = field(default_factory=list)
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

    waiting: np.ndarray  # rows of the waiting requests, in the order given
    active: np.ndarray  # rows of the running and paused, in the order given
    # Every reader's rate, summed: a waiting newcomer's reader reads as
    # soon as it starts, so a burst's need counts before it is admitted.
    required: float
    n_running: int
    blocks: int  # KV blocks of all requests, summed
    active_blocks: int  # KV blocks of the running and paused requests, summed
    waiting_blocks: int  # KV blocks the waiting requests need to start
    tokens_left: int  # output tokens all of them have still to generate

    @property
    def n_active(self) -> int:
        return len(self.active)


def survey(reqs: RequestColumns, rate_cap: float = math.inf) -> Pool:
    """Split and count the requests (it runs over every live request each
    interval that has something waiting or paused). Every reader counts in
    the need, a waiting newcomer's too. A reader needs at most
    `rate_cap` tokens/s (what one running request gets): one that states
    more is served at that speed whatever it states."""
    waiting = reqs.phase == WAITING
    active = np.flatnonzero(~waiting)
    blocks = int(reqs.blocks.sum())
    waiting_blocks = int(reqs.blocks[waiting].sum())
    return Pool(np.flatnonzero(waiting), active, _sum(np.minimum(reqs.rate, rate_cap)),
                int(np.count_nonzero(reqs.phase == RUNNING)), blocks, blocks - waiting_blocks, waiting_blocks,
                int((reqs.max_tokens - reqs.num_output).sum()))


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
    best decode rate seen (short contexts, every slot busy) overstates it.
    Without a fit (a batch that never changes size cannot tell a step's
    fixed cost from its per-token cost), the measured steps/s; but None
    (unknown) while every step seen carried prefill: an engine's first
    steps understate what its batch decodes several times over, and would
    make a light burst look past capacity."""
    if not pool.n_active:
        return None
    usable = eng.total_blocks - headroom_blocks(kv_headroom, eng.total_blocks)
    footprint = pool.active_blocks / pool.n_active + 1
    k = max(1, min(eng.max_num_seqs, int(usable // footprint)))
    if eng.step_cost is not None:
        base, per_token = eng.step_cost
        return k / (base + per_token * k)
    return k * eng.step_rate if eng.step_rate and eng.decode_tps else None


def swap_share(required: float, capacity: float | None) -> float:
    """The share of decode time that swapping readers in and out may take:
    half the spare capacity, 1 - required / capacity. Each swap costs the
    batch a fixed amount of work, so the pause level asks a reader to run
    long enough between swaps to keep within this share. Half, so that what
    the engine delivers stays above what its readers need, with room for
    the estimates' error. At or past capacity the share is 0: a reader
    keeps its slot against readers run dry while its next tokens count for
    as much as theirs would, less the swap's cost, and a newcomer's first
    token goes ahead of every reader with something left to read
    (`TokenFlowPolicy.keys`)."""
    if not capacity:
        return DEFAULT_SWAP_SHARE
    spare = 1.0 - required / capacity
    return spare / 2 if spare > 0.0 else 0.0


@dataclass(slots=True)
class Keys:
    """The rank key of each candidate (steps 4 and 5), as arrays."""

    tier: np.ndarray  # KEEP_RUNNING ... SENT_AHEAD
    value: np.ndarray  # ascending ranks first within a tier (see TokenFlowPolicy.keys)
    cost: np.ndarray  # a guarded reader's swap cost in tokens (0 for the others)


class TokenFlowPolicy:
    def __init__(self, cfg: TokenFlowConfig):
        self.cfg = cfg

    def decide(self, reqs: RequestColumns | list[RequestView], eng: EngineView) -> Decision | None:
        """None means: no stress, leave vLLM's batch as it is."""
        cfg = self.cfg
        cols = _columns(reqs)
        if not len(cols):
            return None
        pool = survey(cols, eng.step_rate or math.inf)
        counts = QueueCounts(pool.n_running, len(pool.waiting), pool.n_active - pool.n_running,
                             pool.waiting_blocks, eng.free_blocks, eng.total_blocks, eng.max_num_seqs)
        if not self.needs_decision(counts):
            return None
        if cfg.overload_factor is not None and eng.decode_tps and pool.required > cfg.overload_factor * eng.decode_tps:
            return self.fcfs(cols, pool, eng)
        capacity = fitting_capacity(pool, eng, cfg.kv_headroom)
        share = swap_share(pool.required, capacity)
        budget = share * capacity * cfg.dt if capacity else 0.0
        work_end = pool.tokens_left / capacity if capacity else 0.0
        by_arrival = pool.waiting[np.argsort(cols.arrival_time[pool.waiting], kind="stable")]
        # The earliest arrivals get the room; the rest are deferred. The
        # working set never defers a newcomer that fits in the free slots and
        # KV now: vLLM alone would admit it this step.
        room = max(self.working_set_room(pool.n_running, pool.n_active, pool.blocks / len(cols), eng),
                   self.fits_now(cols.blocks[by_arrival], pool.n_running, eng))
        # Sorts are stable: equal keys keep the order of the candidates.
        candidates = np.concatenate((pool.active, by_arrival[:room]))
        ordered = self.rank(cols, candidates, eng, share, budget, work_end)
        d = self.to_decision(cols, pool, ordered, self.pack(cols, ordered, eng), by_arrival[room:], eng)
        d.swap_share, d.swap_budget, d.work_end_s = share, budget, work_end
        return d

    def needs_decision(self, q: QueueCounts) -> bool:
        return contended(q, self.cfg.kv_headroom)

    def fcfs(self, cols: RequestColumns, pool: Pool, eng: EngineView) -> Decision:
        """The overload fallback: every request in arrival order, paused
        readers included, packed into the slots and KV as they come (one
        that does not fit is passed over for later ones that do); running
        readers left out pause for the earlier ones, holding their KV where
        the chosen do not need it. Waiting ones left out stay in vLLM's
        queue, which admits them in arrival order as room frees."""
        by_arrival = np.argsort(cols.arrival_time, kind="stable")
        d = self.to_decision(cols, pool, by_arrival, self.pack(cols, by_arrival, eng), by_arrival[:0], eng)
        d.fallback_fcfs, d.swap_share = True, 0.0
        return d

    # --- pieces -----------------------------------------------------------
    def fits_now(self, blocks_by_arrival: np.ndarray, n_running: int, eng: EngineView) -> int:
        """How many of the earliest waiting requests (their KV blocks, in
        arrival order) the free sequence slots and KV blocks (less the
        growth headroom) hold as they are."""
        free = eng.free_blocks - headroom_blocks(self.cfg.kv_headroom, eng.total_blocks)
        fit = int(np.searchsorted(np.cumsum(blocks_by_arrival), free, side="right"))
        return max(0, min(fit, eng.max_num_seqs - n_running))

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

    def rank(self, cols: RequestColumns, candidates: np.ndarray, eng: EngineView,
             share: float = DEFAULT_SWAP_SHARE, budget: float = 0.0, work_end: float = 0.0) -> np.ndarray:
        """Steps 4 and 5, the candidates' rows in rank order: requests that
        must keep running, then those that must resume, each lowest buffer
        first; then the rest by priority U, highest first. Guarded running
        readers rank with the newcomers, by U, ahead of every other running
        or paused request: a paused reader at its resume level takes free
        room or an unguarded reader's place, and a guarded one's only while
        the swaps so made cost the batch at most `budget` tokens (the
        guarded of lowest U first). Those it cannot have wait behind the
        guarded. Readers above their resume level come last when the work
        in hand is known (OUTLASTS, then SENT_AHEAD, see keys()). Sorts are
        stable: equal keys keep the candidates' order."""
        k = self.keys(cols, eng, share, work_end)
        tier, value = k.tier[candidates], k.value[candidates]
        guard = tier == GUARDED
        if not guard.any():
            return candidates[_in_order(tier, value)]
        # Newcomers (no reader yet) rank with the guarded, after them on a tie.
        rest = tier == BY_PRIORITY
        newcomer = rest & (cols.phase[candidates] == WAITING) & ~cols.reading[candidates]
        # Each request's group, in the order the groups are listed.
        keep, resume, ahead, later, others, last = range(6)
        group = np.full(len(candidates), last, dtype=np.int8)
        group[tier == KEEP_RUNNING] = keep
        group[tier == MUST_RESUME] = resume
        group[guard | newcomer] = ahead
        group[rest & ~newcomer] = others
        in_resume = np.flatnonzero(tier == MUST_RESUME)
        if len(in_resume):
            in_resume = in_resume[np.argsort(value[in_resume], kind="stable")]
            held = np.flatnonzero(guard)
            held = held[np.argsort(value[held], kind="stable")]  # highest U first
            in_keep = np.flatnonzero(tier == KEEP_RUNNING)
            in_keep = in_keep[np.argsort(value[in_keep], kind="stable")]
            need = self.needs(cols, candidates, eng)
            costs = k.cost[candidates[held]].tolist()
            room = self.room_beside_guard(need[in_keep].tolist(), need[held].tolist(), costs,
                                          need[in_resume].tolist(), budget, eng)
            group[in_resume[~np.array(room, dtype=bool)]] = later
        # Within the last group OUTLASTS before SENT_AHEAD; within `ahead`
        # the guarded before newcomers of the same U.
        return candidates[_in_order(group, np.where(group == last, tier, 0), value, newcomer)]

    def room_beside_guard(self, keep: list[int], held: list[int], costs: list[float], resume: list[int],
                          budget: float, eng: EngineView) -> list[bool]:
        """Which readers at their resume level (in rank order, by the KV
        blocks each needs, as pack() counts them) the slots and KV hold
        when the guarded (`held`, highest U first, with their swap costs)
        keep theirs, less those whose swaps they may buy: a reader about to
        stall loses what it reads while it waits, and the swap's cost comes
        out of capacity that, below the readers' need, would only fill
        buffers. `budget` bounds that spend per interval as the guard bounds
        each reader's (`swap_share`). The guarded of lowest U are given up
        first, while their swaps fit in the budget and some reader at its
        resume level is still left out. `keep`: the must-run readers ahead
        of them all."""
        cap, _, slots = self.pack_limits(eng)

        def take(need: int, used: int, n: int) -> tuple[int, int]:
            """pack()'s step: the state (blocks used, requests taken) after
            it meets a request needing `need` blocks; a property test holds
            the two equal."""
            if n >= slots or (used + need > cap and n):
                return used, n
            return used + need, n + 1

        # pack()'s state after the keep and after each prefix of the held,
        # so that giving up the last held reader repacks only the resume.
        used = n = 0
        for need in keep:
            if n >= slots:
                break
            used, n = take(need, used, n)
        states = [(used, n)]
        for need in held:
            if n >= slots:  # full: every longer prefix leaves this state
                break
            used, n = take(need, used, n)
            states.append((used, n))
        m = len(held)
        while True:
            (used, n), room = states[min(m, len(states) - 1)], [False] * len(resume)
            for i, need in enumerate(resume):
                if n >= slots:  # full: no later reader fits
                    break
                used, after = take(need, used, n)
                room[i], n = after > n, after
            if not m or all(room) or costs[m - 1] > budget:
                return room
            m -= 1
            budget -= costs[m]

    def keys(self, cols: RequestColumns, eng: EngineView, share: float = DEFAULT_SWAP_SHARE,
             work_end: float = 0.0) -> Keys:
        """The rank key of every request, by row: KEEP_RUNNING and
        MUST_RESUME valued by buffer seconds (step 4), GUARDED, BY_PRIORITY
        and SENT_AHEAD by -U (step 5), OUTLASTS by the seconds its reader
        reads on past the work in hand, negated; ascending value ranks first.
        At capacity (`share` 0) a newcomer is KEEP_RUNNING at 0 s: a reader
        with nothing to read. Each guarded request's swap cost (tokens)
        comes with it.

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
        dt, mu, gamma = cfg.dt, cfg.mu, cfg.gamma
        lv = Levels.of(eng, dt)
        step, load, swap, recompute = lv.step_s, lv.load_per_token, lv.swap_per_token, lv.recompute_per_token
        start = eng.start_s or 0.0  # the batch's cost of (re)adding a request, beyond its tokens
        # A swap's extra prefill holds up the whole batch, so it costs what
        # the batch decodes per second now, not one request's speed.
        batch_tps = lv.step_rate * eng.running if eng.running else (eng.decode_tps or lv.step_rate)
        # Every row, not only the candidates: one gather fewer per column.
        phase, rate, b, n = cols.phase, cols.rate, cols.buffer_tokens, cols.num_tokens
        running, reading = phase == RUNNING, (phase == PAUSED) | cols.reading  # a waiting reader is a released pause
        # The pause level: back in time (released, the worst case) for one
        # more interval, plus the swap's own time. Mid-prefill requests never
        # pause: the work done would be lost.
        resume_level = rate * mu * (n * load + step + dt)
        keep = running & ((cols.num_output == 0) | (b < resume_level + rate * (dt + n * swap + step)))
        # A paused reader's resume level: back in time for one interval.
        back = np.where(cols.kv_resident, step, n * load + step)
        resume = ~running & reading & (b < rate * mu * (back + dt))
        # The tokens the engine loses to a running reader's swap, priced as
        # a release (the worst case, as the pause level is): the measured
        # cost of putting a request back in the batch, plus its recompute.
        # Without a host tier the batch recomputes the whole context. With
        # one, the host holds every full block: the batch recomputes the
        # unfinished tail block, and this slot sits out one step plus the
        # reload. A pause itself costs the others no step
        # (docs/BENCHMARKS.md: a whole step charged at the engine's
        # capacity kept newcomers out for seconds; nothing charged swapped
        # near-equal readers every interval).
        if eng.transfer_tps:
            bonus = (((n - 1) % eng.block_size) * recompute + start) * batch_tps + (step + n * load) * lv.step_rate
        else:
            bonus = (n * recompute + start) * batch_tps
        bonus = bonus * running
        # U's first term: what the next interval's tokens (one request's
        # speed) add to effective throughput, each weighed as the metric
        # weighs it at the buffer it lands on (tokenflow.core.buffer): in
        # full up to a tenth of the answer, falling to nothing at a fifth.
        # (A step at the fifth kept readers decoding tokens that count for
        # little: docs/BENCHMARKS.md, "U weighs the next tokens as the
        # metric does".)
        full = lv.step_rate * dt  # what a slot decodes in an interval
        useful = interval_worth(b, full, rate * dt, cols.max_tokens)  # a faster reader's level does not climb
        # Guarded from paused readers until it has decoded enough since its
        # resume that this swap's cost stays within the share of the engine
        # swaps may take (the reader decodes about `bonus / share` tokens
        # between resume and pause), but never once its next tokens are of
        # no use now. At capacity (share 0) there is no share to spend: it
        # is guarded while its next interval counts at least what a reader
        # run dry would get from its slot (a full interval at a stream's
        # speed), less what the swap costs. Near the part of the answer
        # worth sending ahead its tokens count for less, and it gives way
        # (docs/BENCHMARKS.md, "At capacity, a reader gives way when its
        # next tokens count for less").
        guarded = running & (useful > 0.0)
        if share > 0.0:
            guarded &= b < resume_level + bonus / share
        else:
            guarded &= useful >= full - bonus
        value = -(useful + gamma * np.exp(-b / rate) + bonus)
        tier = np.where(guarded, GUARDED, BY_PRIORITY).astype(np.int8)
        if work_end > 0.0:
            reads_on = b + cols.max_tokens - cols.num_output - rate * work_end  # tokens past the work's end
            past = ~guarded & (running | reading)
            tier[past] = np.where(reads_on[past] < 0.0, SENT_AHEAD, OUTLASTS)
            outlasts = tier == OUTLASTS
            value[outlasts] = -reads_on[outlasts] / rate[outlasts]
        tier[keep] = KEEP_RUNNING
        tier[resume] = MUST_RESUME
        must = keep | resume
        value[must] = (b / rate)[must]
        if share == 0.0:
            # At capacity someone's reader waits whatever is chosen, and a
            # newcomer's waits already: it holds nothing to read. It ranks
            # as a reader with an empty buffer that must run, after a
            # running reader run dry (no swap) and ahead of every other.
            first = (phase == WAITING) & ~cols.reading
            tier[first], value[first] = KEEP_RUNNING, 0.0
        return Keys(tier, value, bonus * (tier == GUARDED))

    def rank_key(self, r: RequestView, eng: EngineView, share: float = DEFAULT_SWAP_SHARE,
                 work_end: float = 0.0) -> tuple[int, float]:
        """(tier, value) of one request: where rank() puts it."""
        k = self.keys(RequestColumns.of([r]), eng, share, work_end)
        return int(k.tier[0]), float(k.value[0])

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

    def needs(self, cols: RequestColumns, rows: np.ndarray, eng: EngineView) -> np.ndarray:
        """KV blocks pack() counts for each of `rows`: a waiting request its
        context's, the others that plus an interval's growth."""
        _, grow, _ = self.pack_limits(eng)
        return cols.blocks[rows] + grow * (cols.phase[rows] != WAITING)

    def pack(self, cols: RequestColumns, ordered: np.ndarray, eng: EngineView) -> np.ndarray:
        """Take the `ordered` rows in order while sequence slots and KV
        blocks last (the first always); one that does not fit is passed
        over for those after it that do."""
        cap, _, slots = self.pack_limits(eng)
        need = self.needs(cols, ordered, eng)
        if not len(ordered) or slots <= 0:
            return ordered[:1]
        if need[0] > cap:
            return ordered[:1]
        # The longest prefix that fits, then one by one.
        fit = min(int(np.searchsorted(np.cumsum(need), cap, side="right")), slots)
        taken, left = list(range(fit)), cap - int(need[:fit].sum())
        if fit < slots and fit + 1 < len(ordered):
            rest = need[fit + 1:].tolist()
            least = min(rest)
            for j, x in enumerate(rest, start=fit + 1):
                if left < least:
                    break
                if x <= left:
                    taken.append(j)
                    left -= x
                    if len(taken) >= slots:
                        break
        return ordered[taken]

    def to_decision(self, cols: RequestColumns, pool: Pool, ordered: np.ndarray, chosen: np.ndarray,
                    deferred: np.ndarray, eng: EngineView) -> Decision:
        """`ordered`: the candidates in rank order; `chosen`: those of them
        that run."""
        ids = cols.ids
        d = Decision(defer=_pick(ids, deferred))
        waiting = cols.phase == WAITING
        # In priority order: vLLM preempts from the tail.
        d.order = _pick(ids, chosen)
        admit, run = chosen[waiting[chosen]], chosen[~waiting[chosen]]
        d.admit = _pick(ids, admit)
        d.run = _pick(ids, run)
        away = run[~cols.kv_resident[run]]  # released: their blocks must come back
        # Blocks the chosen must still get on the device.
        need = int(cols.blocks[admit].sum()) + int(cols.blocks[away].sum())
        d.recompute = _pick(ids, away[self.recomputes(cols, away, eng)])
        taken = np.zeros(len(cols), dtype=bool)
        taken[chosen] = True
        taken[deferred] = True
        # The unchosen keep the given order.
        d.wait = _pick(ids, pool.waiting[~taken[pool.waiting]])
        losers = pool.active[~taken[pool.active]]
        # Unchosen resident requests free KV only as far as the chosen need
        # it, largest buffers (in seconds of reading) first; the rest pause
        # holding their blocks. (Released ones stay so.)
        losers = losers[np.argsort(-(cols.buffer_tokens[losers] / cols.rate[losers]), kind="stable")]
        resident = cols.kv_resident[losers]
        # A resident one is released while what is free before it falls short.
        frees = cols.blocks[losers] * resident
        release = ~resident | (eng.free_blocks + np.cumsum(frees) - frees < need)
        held = losers[~release]
        d.pause_release = _pick(ids, losers[release])
        d.pause_hold = _pick(ids, held)
        holds = np.zeros(len(cols), dtype=bool)
        holds[held] = True
        d.standby = _pick(ids, ordered[holds[ordered]])
        return d

    def recomputes(self, cols: RequestColumns, rows: np.ndarray, eng: EngineView) -> np.ndarray:
        """Of the released `rows`, which come back by recompute (step 6):
        prefilling the context beats moving its host blocks at the measured
        speeds. With no transfer measured yet, or nothing on the host,
        there is nothing to weigh: vLLM then loads whatever the host holds."""
        if not eng.transfer_tps:
            return np.zeros(len(rows), dtype=bool)
        host = cols.host_blocks[rows]
        t_io = host * eng.block_size / eng.transfer_tps
        t_prefill = cols.num_tokens[rows] / eng.prefill_tps if eng.prefill_tps else np.full(len(rows), math.inf)
        return (host != 0) & ~(t_io < t_prefill)

    def resume_mode(self, r: RequestView, eng: EngineView) -> str | None:
        """How a released request comes back (step 6): "reload" or
        "recompute"; None when there is nothing to weigh."""
        if not eng.transfer_tps or r.host_blocks == 0:
            return None
        return "recompute" if self.recomputes(RequestColumns.of([r]), np.zeros(1, dtype=np.intp), eng)[0] else "reload"
