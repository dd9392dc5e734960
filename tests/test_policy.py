"""The TokenFlow and Andes policies alone: behaviour with an injected clock,
and invariants over random populations (hypothesis)."""

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policy_sim import SimEngine, SimRequest
from tokenflow.core.andes import AndesPolicy
from tokenflow.core.buffer import EFFECTIVE_HIGH_FRACTION, EFFECTIVE_LOW_FRACTION
from tokenflow.core.config import TokenFlowConfig, parse_rate
from tokenflow.core.policy import (
    BY_PRIORITY,
    GUARDED,
    KEEP_RUNNING,
    MUST_RESUME,
    OUTLASTS,
    SENT_AHEAD,
    EngineView,
    Phase,
    RequestColumns,
    RequestView,
    TokenFlowPolicy,
)
from tokenflow.tools.bench_policy import population


def ranked(policy, views, eng, share=0.5, budget=0.0, work_end=0.0):
    """The ids of `views` as rank() orders them, given in that order."""
    cols = RequestColumns.of(views)
    return [cols.ids[i] for i in policy.rank(cols, np.arange(len(views)), eng, share, budget, work_end)]


def burst_engine(policy_name="tokenflow", n_old=4, step_rate=50.0):
    cfg = TokenFlowConfig(policy=policy_name, dt=0.5)
    policy = TokenFlowPolicy(cfg) if policy_name == "tokenflow" else AndesPolicy(cfg)
    eng = SimEngine(policy, total_blocks=n_old * 28, max_num_seqs=n_old, step_rate=step_rate)
    for i in range(n_old):
        eng.reqs[f"old{i}"] = SimRequest(f"old{i}", 0.0, rate=10.0, prompt=16, max_tokens=400)
    return eng


def test_newcomer_gets_first_token_while_large_buffers_pause():
    eng = burst_engine()
    eng.run(until=3.0)  # old requests build ~2 s of buffer at 50 tok/s vs reading 10
    assert all(r.phase == Phase.RUNNING for r in eng.reqs.values())
    eng.reqs["new"] = SimRequest("new", eng.now, rate=10.0, prompt=16, max_tokens=400)
    t_arrive = eng.now
    eng.run(until=eng.now + 1.0)
    new = eng.reqs["new"]
    assert new.reader.ttft is not None and new.reader.ttft <= 0.6  # within about one dt
    assert eng.pauses >= 1
    paused = [r for r in eng.reqs.values() if r.phase == Phase.PAUSED]
    assert paused, "a large-buffer request must have made room"
    assert min(r.reader.buffer(eng.now) for r in paused) > 0  # they had buffer to spend
    assert t_arrive < eng.now


def test_fcfs_like_engine_makes_newcomer_wait_without_tokenflow():
    """Control: with pausing disabled (mu huge) the newcomer waits for a slot."""
    eng = burst_engine()
    eng.policy.cfg.mu = 1e9
    eng.run(until=3.0)
    eng.reqs["new"] = SimRequest("new", eng.now, rate=10.0, prompt=16, max_tokens=400)
    eng.run(until=eng.now + 1.0)
    assert eng.reqs["new"].reader.ttft is None


def test_paused_requests_resume_before_running_dry():
    eng = burst_engine(n_old=4)
    eng.run(until=3.0)
    for k in range(2):
        eng.reqs[f"new{k}"] = SimRequest(f"new{k}", eng.now, rate=10.0, prompt=16, max_tokens=400)
    eng.run(until=eng.now + 12.0)
    assert eng.pauses >= 2
    for r in list(eng.reqs.values()) + eng.done:
        assert r.reader.stall_time(eng.now) == 0.0, r.req_id


def test_nothing_starves_in_a_burst():
    cfg = TokenFlowConfig(dt=0.5)
    eng = SimEngine(TokenFlowPolicy(cfg), total_blocks=24, max_num_seqs=4, step_rate=100.0)
    for i in range(12):
        eng.reqs[f"r{i}"] = SimRequest(f"r{i}", 0.0, rate=15.0, prompt=16, max_tokens=60)
    eng.run(until=120.0)
    assert not eng.reqs and len(eng.done) == 12
    assert eng.max_blocks_used <= 24


def test_unstressed_engine_is_left_alone():
    policy = TokenFlowPolicy(TokenFlowConfig())
    reqs = [RequestView("a", Phase.RUNNING, 0.0, 10.0, 50.0, 60, 200, 80, 5, True)]
    eng = EngineView(16, 100, 95, 8, step_rate=50.0)
    assert policy.decide(reqs, eng) is None


def test_overload_falls_back_to_fcfs_when_asked():
    """With `overload_factor` set, readers who need more than that share of
    the capacity are served in arrival order: the earliest take the slots,
    paused ones included, and a later running reader pauses for them."""
    policy = TokenFlowPolicy(TokenFlowConfig(overload_factor=1.0))
    reqs = [RequestView(f"r{i}", Phase.PAUSED, float(i), 40.0, 10.0, 10, 100, 30, 2, True) for i in range(5)]
    eng = EngineView(16, 100, 50, 8, decode_tps=100.0, step_rate=50.0)  # 5 x 40 tokens/s needed
    d = policy.decide(reqs, eng)
    assert d.fallback_fcfs and d.run == [f"r{i}" for i in range(5)]
    # Two slots: the two earliest run; a later running reader, however
    # little it holds, pauses holding its KV; the newcomer waits in vLLM's queue.
    late = RequestView("late", Phase.RUNNING, 9.0, 40.0, 0.0, 10, 100, 30, 2, True)
    new = RequestView("new", Phase.WAITING, 10.0, 40.0, 0.0, 0, 100, 20, 2)
    d = policy.decide(reqs[:2] + [late, new], EngineView(16, 100, 50, 2, decode_tps=100.0, step_rate=50.0))
    assert d.fallback_fcfs and d.run == ["r0", "r1"] and d.order == ["r0", "r1"]
    assert d.pause_hold == ["late"] and d.wait == ["new"] and not d.pause_release


def test_past_capacity_newcomers_still_get_first_tokens_by_default():
    """No fallback unless asked: when the readers need more than the engine
    decodes (swap share 0) the policy still ranks, and a newcomer's first
    token takes the place of a reader holding what is worth sending ahead."""
    policy = TokenFlowPolicy(TokenFlowConfig())
    assert policy.cfg.overload_factor is None
    reqs = [RequestView(f"r{i}", Phase.RUNNING, float(i), 40.0, 200.0, 100, 1000, 130, 9, True) for i in range(2)]
    reqs += [RequestView(f"p{i}", Phase.PAUSED, float(2 + i), 40.0, 300.0, 100, 1000, 130, 9, True) for i in range(3)]
    reqs.append(RequestView("new", Phase.WAITING, 10.0, 40.0, 0.0, 0, 1000, 30, 2))
    eng = EngineView(16, 100, 50, 2, decode_tps=100.0, step_rate=50.0)  # 6 x 40 tokens/s needed
    d = policy.decide(reqs, eng)
    assert d is not None and not d.fallback_fcfs and d.swap_share == 0.0
    assert d.admit == ["new"] and len(d.run) == 1


def test_before_a_decode_step_is_measured_a_burst_is_not_taken_for_past_capacity():
    """An engine's first steps carry prefill: 4.5 steps/s, far below what
    its batch decodes once the prompts are in. Until a decode-only step
    has been seen, or decode steps fitted, the capacity is unknown, so the
    readers that have just begun keep their slots and newcomers take the
    free ones (read as capacity, 32 slots x 4.5 = 144 tokens/s against the
    480 needed would hold every reader for a newcomer)."""
    policy = TokenFlowPolicy(TokenFlowConfig())
    readers = [RequestView(f"r{i}", Phase.RUNNING, 0.0, 10.0, 3.0, 3, 400, 43, 3, True) for i in range(16)]
    newcomers = [RequestView(f"n{i}", Phase.WAITING, 1.0 + i, 10.0, 0.0, 0, 400, 40, 3) for i in range(32)]
    d = policy.decide(readers + newcomers, EngineView(16, 1000, 950, 32, step_rate=4.5, running=16))
    assert d is not None and d.swap_share > 0.0, d
    assert sorted(d.run) == sorted(r.req_id for r in readers) and not d.pause_hold and not d.pause_release, d
    assert d.admit == [f"n{i}" for i in range(16)], d
    # Once decode steps are measured that slow, the same burst is past capacity.
    for measured in ({"decode_tps": 144.0}, {"step_cost": (0.2, 0.0)}):
        eng = EngineView(16, 1000, 950, 32, step_rate=4.5, running=16, **measured)
        assert policy.decide(readers + newcomers, eng).swap_share == 0.0, measured


def test_at_capacity_a_newcomer_s_first_token_goes_ahead_of_readers_with_something_to_read():
    """Two readers run with a few tokens in hand, below their pause level,
    and a newcomer waits. While the three need less than the engine
    decodes, the readers keep their slots and the newcomer waits for one.
    When they need more (the newcomer's reader counted with the others:
    it reads as soon as it starts), someone's reader waits whatever is
    chosen, and the newcomer's waits already: it takes the slot of the
    reader holding more to read, which pauses keeping its KV."""
    policy = TokenFlowPolicy(TokenFlowConfig())
    eng = EngineView(16, 100, 50, 2, decode_tps=100.0, step_rate=50.0)  # 2 slots at 50 tokens/s

    def burst(rate):
        running = [RequestView(f"r{i}", Phase.RUNNING, 0.0, 40.0, 5.0 * (i + 1), 10, 1000, 50, 4, True)
                   for i in range(2)]
        return running + [RequestView("new", Phase.WAITING, 1.0, rate, 0.0, 0, 1000, 40, 3)]

    under = policy.decide(burst(10.0), eng)  # 90 of 100 tokens/s
    assert under.swap_share > 0.0 and sorted(under.run) == ["r0", "r1"] and under.wait == ["new"], under
    past = policy.decide(burst(40.0), eng)  # 120 of 100: the two readers alone need 80
    assert past.swap_share == 0.0 and past.admit == ["new"] and past.run == ["r0"], past
    assert past.pause_hold == ["r1"] and past.order == ["new", "r0"]


def test_swaps_grow_rarer_as_the_readers_need_nears_what_fits():
    """A reader at its resume level takes the slot of a running reader with
    3 s of buffer while the readers need little of what the engine decodes;
    when they need most of it, each swap's cost would eat the spare, so the
    running reader keeps its slot against readers (at or past capacity,
    always), though not against a newcomer's first token."""
    policy = TokenFlowPolicy(TokenFlowConfig(dt=0.1))
    # 4 slots at 100 tokens/s each: 400 tokens/s; a host tier; 1 ms a token recomputed.
    eng = EngineView(16, 1000, 960, 4, decode_tps=400.0, step_rate=100.0, prefill_tps=1000.0,
                     step_cost=(0.01, 0.0), transfer_tps=1e5, host_blocks=1000, running=4)
    running = [RequestView(f"run{i}", Phase.RUNNING, 0.0, 10.0, 30.0, 40, 1000, 100, 7, True) for i in range(4)]
    dry = RequestView("dry", Phase.PAUSED, 0.0, 10.0, 0.0, 40, 1000, 100, 7, False, host_blocks=6)
    light = policy.decide(running + [dry], eng)
    assert "dry" in light.run and light.swap_share > 0.4
    # Readers parked with 100 s of buffer each, who need 320 tokens/s between them.
    parked = [RequestView(f"far{i}", Phase.PAUSED, 0.0, 80.0, 8000.0, 900, 1000, 960, 61, False) for i in range(4)]
    near = policy.decide(running + [dry] + parked, eng)
    assert not near.fallback_fcfs and 0 < near.swap_share < 0.05
    assert sorted(near.run) == [f"run{i}" for i in range(4)] and "dry" not in near.run
    # A newcomer's first token still takes a guarded reader's place.
    new = RequestView("new", Phase.WAITING, 1.0, 10.0, 0.0, 0, 1000, 60, 4)
    first = policy.decide(running + [dry, new] + parked, eng)
    assert first.admit == ["new"] and len(first.run) == 3 and "dry" not in first.run


def test_at_capacity_a_reader_gives_way_once_its_next_tokens_are_worth_less_than_a_dry_reader_s():
    """At capacity the guard keeps a running reader decoding against
    readers at their resume level only while its next interval's tokens
    count as much as a dry reader's would (a full interval at the stream's
    speed), less what the swap costs the batch. Past that, near the part of
    the answer worth sending ahead (U's `useful` falls there), a reader
    about to run dry takes its place, and it pauses holding its KV."""
    policy = TokenFlowPolicy(TokenFlowConfig(dt=0.1))
    # 4 slots at 100 tokens/s: 400 tokens/s fit; 500 tokens/s the best seen.
    eng = EngineView(16, 1000, 960, 4, decode_tps=500.0, step_rate=100.0, prefill_tps=1000.0,
                     step_cost=(0.01, 0.0), transfer_tps=1e5, host_blocks=1000, running=4)
    running = [RequestView(f"run{i}", Phase.RUNNING, 0.0, 10.0, 30.0, 40, 1000, 100, 7, True) for i in range(4)]
    dry = RequestView("dry", Phase.PAUSED, 0.0, 10.0, 0.0, 40, 1000, 100, 7, False, host_blocks=6)
    # Readers parked with lots of buffer who need 400 tokens/s between them: past what fits.
    parked = [RequestView(f"far{i}", Phase.PAUSED, 0.0, 100.0, 9000.0, 900, 1000, 960, 61, False) for i in range(4)]
    at = policy.decide(running + [dry] + parked, eng)
    assert not at.fallback_fcfs and at.swap_share == 0.0
    assert sorted(at.run) == [f"run{i}" for i in range(4)]  # 30 tokens of the 200 worth sending: guarded
    # One of them holds 125 tokens: its next interval's 10 tokens (it reads
    # 1 meanwhile) arrive where a token's weight falls from 1 at a tenth of
    # its answer (100) to 0 at a fifth, and count about 7.0 in all; a dry
    # reader's count 10, and the swap costs about 2.3.
    full = RequestView("run3", Phase.RUNNING, 0.0, 10.0, 125.0, 40, 1000, 100, 7, True)
    d = policy.decide(running[:3] + [full, dry] + parked, eng)
    assert d.swap_share == 0.0 and sorted(d.run) == ["dry", "run0", "run1", "run2"] and d.pause_hold == ["run3"], d
    assert policy.rank_key(full, eng, 0.0)[0] == BY_PRIORITY
    # At 115 they count about 8.0: more than the 10 less the swap's cost; the guard holds.
    under = RequestView("run3", Phase.RUNNING, 0.0, 10.0, 115.0, 40, 1000, 100, 7, True)
    assert policy.rank_key(under, eng, 0.0)[0] == GUARDED


def test_spare_room_goes_to_a_reader_whose_answer_outlasts_the_work_in_hand():
    """One slot, spare capacity, and two readers who both hold more than is
    worth sending now. The fast one finishes reading (its buffer and the 100
    tokens it has left, at 40 tokens/s: 6.25 s) before the work in hand ends
    (1,000 tokens at 100 tokens/s: 10 s), so it can get each token just in
    time; a token sent to it now would land past its cap and count for
    nothing. The slow one reads for 210 s more: some of its tokens go out
    ahead of need whatever is chosen. The slot goes to the slow one, and the
    fast one waits, holding its KV, for its resume level. Of readers who
    read on past the work, the one reading on longest gets the room first."""
    policy = TokenFlowPolicy(TokenFlowConfig(dt=0.5))
    eng = EngineView(16, 1000, 960, 1, decode_tps=100.0, step_rate=100.0, prefill_tps=1000.0,
                     step_cost=(0.01, 0.0), transfer_tps=1e5, host_blocks=1000, running=1)
    fast = RequestView("fast", Phase.RUNNING, 0.0, 40.0, 150.0, 400, 500, 416, 27, True)
    slow = RequestView("slow", Phase.PAUSED, 0.0, 5.0, 300.0, 100, 1000, 116, 8, False, host_blocks=7)
    d = policy.decide([fast, slow], eng)
    assert not d.fallback_fcfs and d.work_end_s == pytest.approx(10.0)
    assert d.run == ["slow"] and d.pause_hold == ["fast"], d
    assert policy.rank_key(fast, eng, d.swap_share, d.work_end_s)[0] == SENT_AHEAD
    assert policy.rank_key(slow, eng, d.swap_share, d.work_end_s)[0] == OUTLASTS
    # Of two readers who read on past the work, the one reading on longer first.
    medium = RequestView("medium", Phase.PAUSED, 0.0, 10.0, 300.0, 100, 1000, 116, 8, False, host_blocks=7)
    assert ranked(policy, [fast, medium, slow], eng, d.swap_share, budget=0.0, work_end=10.0) \
        == ["slow", "medium", "fast"]
    # Without a measure of capacity there is no work end: U alone ranks, and
    # the running reader keeps its slot (its swap would cost the batch).
    assert ranked(policy, [fast, slow], eng, d.swap_share) == ["fast", "slow"]


def test_readers_about_to_stall_buy_guarded_places_within_the_swap_budget():
    """Five readers at their resume level, four guarded readers in the four
    slots. With spare capacity the stalling readers take guarded places
    while the swaps cost at most the interval's budget (the share of what
    the engine decodes in an interval): 3 of the 5 here, each swap costing
    about 22 tokens of a 77-token budget. Near capacity the budget buys no
    swap and the guarded keep their slots."""
    policy = TokenFlowPolicy(TokenFlowConfig(dt=0.5))
    # 4 slots, 400 tokens/s; re-adding a request costs the batch 50 ms.
    eng = EngineView(16, 1000, 960, 4, decode_tps=400.0, step_rate=100.0, prefill_tps=1000.0,
                     step_cost=(0.01, 0.0), transfer_tps=1e5, host_blocks=1000, running=4, start_s=0.05)
    running = [RequestView(f"run{i}", Phase.RUNNING, 0.0, 10.0, 30.0, 40, 1000, 100, 7, True) for i in range(4)]
    dry = [RequestView(f"dry{i}", Phase.PAUSED, 0.0, 10.0, 0.0, 40, 1000, 100, 7, False, host_blocks=6)
           for i in range(5)]
    d = policy.decide(running + dry, eng)
    assert all(policy.rank_key(r, eng, d.swap_share)[0] == GUARDED for r in running)
    assert 70 < d.swap_budget < 85, d.swap_budget
    assert sorted(d.run) == ["dry0", "dry1", "dry2", "run0"], d.run
    # Readers parked with lots of buffer need 280 tokens/s more: near capacity.
    parked = [RequestView(f"far{i}", Phase.PAUSED, 0.0, 70.0, 7000.0, 900, 1000, 960, 61, False) for i in range(4)]
    near = policy.decide(running + dry + parked, eng)
    assert 0 < near.swap_budget < 22, near.swap_budget
    assert sorted(near.run) == [f"run{i}" for i in range(4)]


# --- invariants -------------------------------------------------------------
phases = st.sampled_from([Phase.WAITING, Phase.RUNNING, Phase.PAUSED])


@st.composite
def populations(draw):
    n = draw(st.integers(1, 40))
    reqs = []
    for i in range(n):
        phase = draw(phases)
        out = 0 if phase == Phase.WAITING and draw(st.booleans()) else draw(st.integers(0, 300))
        prompt = draw(st.integers(1, 200))
        reqs.append(RequestView(
            req_id=f"r{i}", phase=phase, arrival_time=draw(st.floats(0, 100)),
            rate=draw(st.floats(1, 50)), buffer_tokens=draw(st.floats(0, 300)) if out else 0.0,
            num_output=out, max_tokens=out + draw(st.integers(1, 300)), num_tokens=prompt + out,
            blocks=(prompt + out) // 16 + 1,
            kv_resident=phase == Phase.RUNNING or (phase == Phase.PAUSED and draw(st.booleans())),
        ))
    total = draw(st.integers(8, 400))
    used = sum(r.blocks for r in reqs if r.kv_resident)
    eng = EngineView(block_size=16, total_blocks=total, free_blocks=max(0, total - used),
                     max_num_seqs=draw(st.integers(1, 64)),
                     decode_tps=draw(st.one_of(st.none(), st.floats(100, 10_000))),
                     step_rate=draw(st.one_of(st.none(), st.floats(1, 200))),
                     prefill_tps=draw(st.one_of(st.none(), st.floats(100, 10_000))),
                     step_cost=draw(st.one_of(st.none(), st.tuples(st.floats(0.001, 0.1), st.floats(0, 0.01)))),
                     running=draw(st.integers(0, 64)))
    return reqs, eng


@settings(max_examples=300, deadline=None)
@given(populations(), st.sampled_from(["tokenflow", "andes"]), st.sampled_from([None, 1.0]))
def test_decision_invariants(pop, name, overload_factor):
    reqs, eng = pop
    cfg = TokenFlowConfig(policy=name, overload_factor=overload_factor)
    policy = TokenFlowPolicy(cfg) if name == "tokenflow" else AndesPolicy(cfg)
    d = policy.decide(reqs, eng)
    if d is None:
        return
    groups = [d.run, d.pause_hold, d.pause_release, d.admit, d.defer, d.wait]
    ids = [i for g in groups for i in g]
    assert sorted(ids) == sorted(r.req_id for r in reqs), "every request gets exactly one fate"
    by_id = {r.req_id: r for r in reqs}
    assert all(by_id[i].phase == Phase.WAITING for i in d.admit + d.defer + d.wait)
    assert all(by_id[i].phase != Phase.WAITING for i in d.run + d.pause_hold + d.pause_release)
    assert set(d.recompute) <= set(d.run)
    on_device = d.run + d.admit
    assert len(on_device) <= eng.max_num_seqs
    blocks = sum(by_id[i].blocks for i in on_device)
    assert blocks <= eng.total_blocks or len(on_device) == 1
    assert not any(not by_id[i].kv_resident for i in d.pause_hold), "cannot hold KV it does not have"
    assert set(d.standby) <= set(d.pause_hold), "only a held request comes back without a decision"
    if d.fallback_fcfs:  # in arrival order
        arrivals = [by_id[i].arrival_time for i in d.order]
        assert arrivals == sorted(arrivals)
        return
    if name == "tokenflow":
        pinned = [r for r in reqs if r.phase != Phase.WAITING and policy.must_run(r, eng, d.swap_share)]
        # At capacity a newcomer not deferred must run too, ahead of them.
        first = [r for r in reqs if r.phase == Phase.WAITING and r.req_id not in d.defer
                 and policy.must_run(r, eng, d.swap_share)]
        # A reader at its resume level is owed room only beside the guarded ones.
        guarded = [r for r in reqs if policy.rank_key(r, eng, d.swap_share)[0] == GUARDED]
        grow = math.ceil((eng.step_rate or 1.0) * cfg.dt / eng.block_size)
        need = sum(r.blocks + grow for r in pinned + guarded) + sum(r.blocks for r in first)
        budget = eng.total_blocks - math.ceil(cfg.kv_headroom * eng.total_blocks)
        if len(pinned) + len(first) + len(guarded) <= eng.max_num_seqs and need <= budget:
            assert {r.req_id for r in pinned} <= set(d.run), "a reader about to run dry was paused"
            assert {r.req_id for r in first} <= set(d.admit), "a newcomer waited past capacity"


def test_decision_time_is_small_at_400():
    """Sanity bound only; the real figures come from `tokenflow bench-policy`."""
    import random
    rng = random.Random(0)
    reqs = [RequestView(f"r{i}", rng.choice(list(Phase)), rng.random(), 20.0, rng.random() * 100, 50, 200,
                        100, 7, True) for i in range(400)]
    eng = EngineView(16, 4000, 100, 256, decode_tps=50_000.0, step_rate=50.0, prefill_tps=1e4)
    policy = TokenFlowPolicy(TokenFlowConfig())
    t = time.perf_counter()
    for _ in range(10):
        policy.decide(reqs, eng)
    assert (time.perf_counter() - t) / 10 < 0.05


# --- the rank key against the paper's rules, written plainly ----------------------
# The key is tuned for speed (constants bound once, comparisons for clamps);
# this is steps 4 and 5 with min()/max(), which it must equal exactly.
def reference_key(cfg, r, eng, share=0.5, work_end=0.0):
    step_rate = eng.step_rate or 1.0 / cfg.dt
    speed_dt = step_rate * cfg.dt
    if eng.transfer_tps:
        load, swap = 1.0 / eng.transfer_tps, 2.0 / eng.transfer_tps
    else:
        load = swap = 1.0 / eng.prefill_tps if eng.prefill_tps else 0.0
    rate, b, n, step = r.rate, r.buffer_tokens, r.num_tokens, 1.0 / step_rate
    bonus, tier = 0.0, BY_PRIORITY
    useful = reference_worth(b, speed_dt, rate * cfg.dt, r.max_tokens)  # U's first term
    if r.phase is Phase.RUNNING:
        if not r.num_output:
            return KEEP_RUNNING, b / rate
        # what the swap costs, priced as a release: the batch recomputes the
        # context (no host tier) or its unfinished tail block (host tier,
        # whose slot also sits out a step and the reload)
        recompute = 1.0 / eng.prefill_tps if eng.prefill_tps else 0.0
        batch_tps = step_rate * eng.running if eng.running else (eng.decode_tps or step_rate)
        start = eng.start_s or 0.0  # the batch's cost of (re)adding a request
        if eng.transfer_tps:
            bonus = (((n - 1) % eng.block_size) * recompute + start) * batch_tps + (step + n * load) * step_rate
        else:
            bonus = (n * recompute + start) * batch_tps
        # paused only past the resume level by one interval and the swap's
        # time; guarded from paused readers until past it by enough decoding
        # that the swap's cost stays within its share of the engine
        resume_level = rate * cfg.mu * (n * load + step + cfg.dt)
        if b < resume_level + rate * (cfg.dt + n * swap + step):
            return KEEP_RUNNING, b / rate
        if useful > 0 and (useful >= speed_dt - bonus if share == 0 else b < resume_level + bonus / share):
            tier = GUARDED
    elif share == 0 and r.phase is Phase.WAITING and not r.reading:
        return KEEP_RUNNING, 0.0  # at capacity a newcomer must run as a reader with nothing to read
    elif r.phase is Phase.PAUSED or r.reading:  # a waiting reader: a released pause
        back = step if r.kv_resident else n * load + step
        if b / rate < cfg.mu * (back + cfg.dt):
            return MUST_RESUME, b / rate
    # once the work in hand is known, a reader above its resume level takes
    # only the room newcomers and readers about to run dry leave: first the
    # readers who read on past the end of that work, longest first, then
    # (served just in time otherwise) those who finish within it, by U
    if tier == BY_PRIORITY and work_end > 0 and (r.phase is not Phase.WAITING or r.reading):
        reads_on = b + r.max_tokens - r.num_output - rate * work_end
        if reads_on >= 0:
            return OUTLASTS, -reads_on / rate
        tier = SENT_AHEAD
    return tier, -(useful + cfg.gamma * math.exp(-b / rate) + bonus)


def reference_worth(b, count, read, output_len):
    """interval_worth() written plainly: the token weights (full up to a
    tenth of the answer, falling to none at a fifth) summed over the
    levels the buffer climbs through while `count` tokens come and `read`
    are read."""
    low, high = EFFECTIVE_LOW_FRACTION * output_len, EFFECTIVE_HIGH_FRACTION * output_len

    def area(x):  # weight summed over levels 0..x
        if x <= low:
            return x
        if x <= high:
            return low + (x - low) - (x - low) ** 2 / (2 * (high - low))
        return low + (high - low) / 2

    rise = max(0.0, 1 - read / count)
    if rise <= 1e-6:  # the level does not climb: each token at today's weight
        return count * min(1.0, max(0.0, (high - b) / (high - low)))
    return (area(b + count * rise) - area(b)) / rise


@st.composite
def tied_populations(draw):
    """Few distinct values, so equal keys and equal buffers are common (the
    sorts' tie order then decides), with offload and knob variations."""
    n = draw(st.integers(1, 60))
    reqs = []
    for i in range(n):
        phase = draw(phases)
        out = draw(st.sampled_from([0, 0, 5, 100])) if phase != Phase.WAITING else draw(st.sampled_from([0, 0, 3]))
        resident = phase == Phase.RUNNING or (phase == Phase.PAUSED and draw(st.booleans()))
        reqs.append(RequestView(
            req_id=f"r{i}", phase=phase, arrival_time=draw(st.sampled_from([0.0, 1.0, 2.0])),
            rate=draw(st.sampled_from([5.0, 10.0, 40.0])),
            buffer_tokens=draw(st.sampled_from([0.0, 2.5, 10.0, 50.0, 400.0])) if out else 0.0,
            num_output=out, max_tokens=out + draw(st.sampled_from([1, 50, 500])),
            num_tokens=16 + out, blocks=draw(st.sampled_from([1, 2, 8])), kv_resident=resident,
            host_blocks=0 if resident else draw(st.sampled_from([0, 1, 8])),
            reading=phase == Phase.WAITING and draw(st.booleans()),  # a continued stream
        ))
    total = draw(st.integers(4, 200))
    used = sum(r.blocks for r in reqs if r.kv_resident)
    eng = EngineView(block_size=16, total_blocks=total, free_blocks=max(0, total - used),
                     max_num_seqs=draw(st.integers(1, 64)),
                     decode_tps=draw(st.one_of(st.none(), st.sampled_from([50.0, 1000.0, 1e6]))),
                     step_rate=draw(st.one_of(st.none(), st.sampled_from([10.0, 50.0]))),
                     prefill_tps=draw(st.one_of(st.none(), st.sampled_from([100.0, 20_000.0]))),
                     transfer_tps=draw(st.one_of(st.none(), st.sampled_from([1000.0, 200_000.0]))),
                     host_blocks=draw(st.sampled_from([0, 50])), running=draw(st.sampled_from([0, 3, 30])),
                     start_s=draw(st.sampled_from([None, 0.0, 0.002])))
    cfg = TokenFlowConfig(mu=draw(st.sampled_from([1.0, 20.0])), gamma=draw(st.sampled_from([0.0, 50.0])),
                          dt=draw(st.sampled_from([0.05, 0.5])))
    return reqs, eng, cfg


@settings(max_examples=300, deadline=None)
@given(tied_populations(), st.sampled_from([0.0, 5.0, 100.0]), st.sampled_from([0.5, 0.05, 0.0]))
def test_rank_key_is_the_papers_rules(pop, work_end, share):
    """The key over all rows at once equals the rules applied to each
    request alone (the value to within numpy's exp, an ulp from math's)."""
    reqs, eng, cfg = pop
    policy = TokenFlowPolicy(cfg)
    expected = [reference_key(cfg, r, eng, share, work_end) for r in reqs]
    keys = policy.keys(RequestColumns.of(reqs), eng, share, work_end)
    assert keys.tier.tolist() == [tier for tier, _ in expected]
    assert keys.value.tolist() == pytest.approx([value for _, value in expected], rel=1e-12, abs=1e-12)
    assert [policy.rank_key(r, eng, share, work_end) for r in reqs] == \
        [(int(t), float(v)) for t, v in zip(keys.tier, keys.value)]


def reference_room(policy, cols, keep, held, costs, resume, budget, eng):
    """room_beside_guard() written plainly: pack everyone again each time
    the guarded reader of lowest U gives up its place."""
    held, costs = list(held), list(costs)
    while True:
        room = set(policy.pack(cols, np.array(keep + held + resume, dtype=np.intp), eng).tolist())
        if not held or all(r in room for r in resume) or costs[-1] > budget:
            return [r in room for r in resume]
        held.pop()
        budget -= costs.pop()


@settings(max_examples=300, deadline=None)
@given(tied_populations(), st.sampled_from([0.0, 0.5, 0.05]), st.floats(0, 500))
def test_room_beside_the_guard_is_one_pack_of_the_plain_loop(pop, share, budget):
    reqs, eng, cfg = pop
    policy = TokenFlowPolicy(cfg)
    cols = RequestColumns.of(reqs)
    k = policy.keys(cols, eng, share)

    def tier(t):  # rows of a tier, lowest value first
        rows = np.flatnonzero(k.tier == t)
        return rows[np.argsort(k.value[rows], kind="stable")].tolist()

    keep, held, resume = tier(KEEP_RUNNING), tier(GUARDED), tier(MUST_RESUME)
    costs = k.cost[held].tolist()
    need = policy.needs(cols, np.arange(len(reqs)), eng)
    assert policy.room_beside_guard(need[keep].tolist(), need[held].tolist(), costs, need[resume].tolist(),
                                    budget, eng) == reference_room(policy, cols, keep, held, costs, resume, budget, eng)


def check_follows_rank(policy, reqs, eng):
    """The decision keeps the rank's order (the standby too), and of the
    paused ones left out, those that give their KV up have the larger
    buffers."""
    d = policy.decide(reqs, eng)
    if d is None or d.fallback_fcfs:
        return
    chosen = set(d.order)
    # As decide() lists them: paused and running as given, then newcomers by arrival.
    newcomers = sorted((r for r in reqs if r.phase is Phase.WAITING and r.req_id in chosen),
                       key=lambda r: r.arrival_time)
    candidates = [r for r in reqs if r.phase is not Phase.WAITING] + newcomers
    order = ranked(policy, candidates, eng, d.swap_share, d.swap_budget, d.work_end_s)
    assert d.order == [i for i in order if i in chosen]
    # Slots that free before the next decision go to the held, in rank order.
    assert d.standby == [i for i in order if i in set(d.pause_hold)]
    by_id = {r.req_id: r for r in reqs}
    released = [by_id[i].buffer_s for i in d.pause_release if by_id[i].kv_resident]
    held = [by_id[i].buffer_s for i in d.pause_hold]
    assert not released or not held or min(released) >= max(held)


@settings(max_examples=300, deadline=None)
@given(tied_populations())
def test_decision_follows_the_rank(pop):
    reqs, eng, cfg = pop
    check_follows_rank(TokenFlowPolicy(cfg), reqs, eng)


def test_decision_follows_the_rank_on_bench_populations():
    import dataclasses

    for n in (100, 400, 1000):
        for seed in range(3):
            reqs, eng = population(n, seed)
            for e in (eng, dataclasses.replace(eng, transfer_tps=None, step_rate=None)):
                policy = TokenFlowPolicy(TokenFlowConfig())
                d = policy.decide(reqs, e)
                assert d is not None and not d.fallback_fcfs
                check_follows_rank(policy, reqs, e)


def test_resume_mode_follows_the_measured_costs():
    """A released request comes back by reload when moving its host blocks
    is faster than prefilling its context, by recompute when prefill is
    faster, and as vLLM does by default (load what the host has) when no
    transfer speed has been measured yet."""
    def released(i, tokens, host_blocks):
        return RequestView(req_id=f"p{i}", phase=Phase.PAUSED, arrival_time=0.0, rate=10.0, buffer_tokens=0.0,
                           num_output=10, max_tokens=100, num_tokens=tokens, blocks=tokens // 16 + 1,
                           kv_resident=False, host_blocks=host_blocks)

    waiting = RequestView(req_id="w", phase=Phase.WAITING, arrival_time=1.0, rate=10.0, buffer_tokens=0.0,
                          num_output=0, max_tokens=100, num_tokens=16, blocks=2)
    reqs = [released(0, 1600, 100), released(1, 1600, 0), waiting]

    def decide(transfer_tps, prefill_tps):
        eng = EngineView(block_size=16, total_blocks=1000, free_blocks=1000, max_num_seqs=8,
                         decode_tps=1000.0, step_rate=50.0, prefill_tps=prefill_tps, transfer_tps=transfer_tps)
        return TokenFlowPolicy(TokenFlowConfig()).decide(reqs, eng)

    fast_bus = decide(transfer_tps=1e6, prefill_tps=1e3)  # 1.6 ms to load, 1.6 s to prefill
    assert "p0" in fast_bus.run and fast_bus.recompute == []  # reloaded, as vLLM does unasked
    slow_bus = decide(transfer_tps=1e2, prefill_tps=1e5)  # 16 s to load, 16 ms to prefill
    assert "p0" in slow_bus.run and slow_bus.recompute == ["p0"]
    unmeasured = decide(transfer_tps=None, prefill_tps=1e5)
    assert unmeasured.recompute == []
    assert {"p0", "p1"} <= set(fast_bus.run)  # p1 has nothing on the host: recompute either way


def test_a_reader_faster_than_the_engine_does_not_force_the_fallback():
    """Readers need at most what one running request gets (step_rate): one
    that states 10,000 tokens/s counts as needing 50, so the rest are still
    scheduled by the policy, not by arrival."""
    policy = TokenFlowPolicy(TokenFlowConfig())
    reqs = [RequestView(f"r{i}", Phase.RUNNING, float(i), 10.0, 200.0, 100, 1000, 130, 9, True) for i in range(8)]
    reqs.append(RequestView("fast", Phase.RUNNING, 9.0, 10_000.0, 0.0, 100, 1000, 130, 9, True))
    reqs.append(RequestView("new", Phase.WAITING, 10.0, 10.0, 0.0, 0, 1000, 30, 2))
    eng = EngineView(16, 100, 10, 9, decode_tps=400.0, step_rate=50.0, prefill_tps=1e4)
    d = policy.decide(reqs, eng)
    assert d is not None and not d.fallback_fcfs
    assert "fast" in d.run and "new" in d.admit  # it keeps running; the newcomer gets its first token


def test_reading_rate_bounds():
    cfg = TokenFlowConfig()
    assert parse_rate(None, cfg) == cfg.default_rate and parse_rate("4", cfg) == 4.0
    for bad in (1e-9, 0.1, 0, -1, float("nan"), 1e6, True, "fast"):
        with pytest.raises(ValueError):
            parse_rate(bad, cfg)


def test_newcomers_that_fit_now_are_never_deferred():
    """A burst onto an idle engine: the working set (lambda) would admit
    half, but every newcomer that fits in the free slots and KV starts now,
    as vLLM alone would start it; only the overflow is deferred."""
    policy = TokenFlowPolicy(TokenFlowConfig(recompute_overcommit=0.0))
    reqs = [RequestView(f"w{i}", Phase.WAITING, float(i), 10.0, 0.0, 0, 512, 60, 2) for i in range(40)]
    eng = EngineView(32, 100, 100, 32, decode_tps=1000.0, step_rate=30.0, prefill_tps=1e4)
    assert policy.working_set_room(0, 0, 2.0, eng) < 32  # lambda alone would admit fewer
    d = policy.decide(reqs, eng)
    assert d.admit == [f"w{i}" for i in range(32)]  # every free slot, earliest first
    assert set(d.admit) | set(d.defer) | set(d.wait) == {r.req_id for r in reqs}


def test_a_continued_stream_jumps_ahead_of_newcomers_only_when_its_reader_runs_dry():
    """A stream continued from a lost engine waits like a newcomer, but its
    reader reads on: with 0.2 s of text left it is admitted before the
    newcomers; with 10 s left the newcomers go first."""
    policy = TokenFlowPolicy(TokenFlowConfig(dt=0.5))
    eng = EngineView(16, 40, 20, 4, decode_tps=400.0, step_rate=100.0, prefill_tps=5e3)
    running = [RequestView(f"run{i}", Phase.RUNNING, 0.0, 10.0, 0.0, 50, 400, 100, 7, True) for i in range(2)]
    newcomers = [RequestView(f"new{i}", Phase.WAITING, 5.0 + i, 10.0, 0.0, 0, 400, 40, 3) for i in range(4)]

    def admitted(buffer_s: float) -> list[str]:
        cont = RequestView("cont", Phase.WAITING, 6.0, 10.0, 10.0 * buffer_s, 0, 300, 140, 9, reading=True)
        d = policy.decide(running + newcomers + [cont], eng)
        return [i for i in d.order if i not in {r.req_id for r in running}]

    assert admitted(0.2)[0] == "cont"
    assert "cont" not in admitted(10.0)[:2]


def test_bench_policy_against_another_policy_module(tmp_path):
    """The A/B command times both and checks their decisions agree; a
    changed decision shows as same_decision false; a bad path is a CLI error."""
    import subprocess
    import sys

    from tokenflow.core import policy as this
    from tokenflow.tools.bench_policy import compare

    row = compare(this.__file__, n=400, rounds=2, per_round=1)
    assert row["same_decision"] and row["this_median_ms"] > 0 and row["other_median_ms"] > 0
    changed = tmp_path / "policy.py"
    changed.write_text(open(this.__file__).read().replace("value[must] = (b / rate)[must]", "value[must] = (-b / rate)[must]"))
    assert compare(str(changed), n=400, rounds=2, per_round=1)["same_decision"] is False
    # The stalling population: readers at their resume level buy guarded
    # places; a policy that stops after the first decides differently.
    stingy = tmp_path / "stingy.py"
    stingy.write_text(open(this.__file__).read().replace("budget -= costs[m]", "budget = -1.0"))
    assert compare(this.__file__, n=100, rounds=2, per_round=1, population_name="stalling")["same_decision"]
    assert compare(str(stingy), n=100, rounds=2, per_round=1, population_name="stalling")["same_decision"] is False
    out = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "bench-policy", "--against", "/no/such.py"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no such policy module" in out.stderr
