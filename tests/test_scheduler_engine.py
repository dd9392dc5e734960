"""TokenFlow inside a real vLLM engine (CPU build, tiny model, small KV pool)."""

from __future__ import annotations

import gc

import pytest

from tests.engines import burst_prompts, make_llm, scheduler_of

pytestmark = pytest.mark.slow

TF = "tokenflow.engine.scheduler.TokenFlowScheduler"
FAST = {"dt": 0.02}  # decide often: the tiny model finishes a burst in about a second


def greedy(n=96, rate=20.0):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, extra_args={"consumption_rate": rate})


def generate(scheduler_cls=None, tokenflow=None, prompts=None):
    llm = make_llm(scheduler_cls, tokenflow)
    prompts = prompts or burst_prompts()
    outs = llm.generate(prompts, [greedy() for _ in prompts], use_tqdm=False)
    sched = scheduler_of(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = getattr(sched, "tf_stats", None)
    core = llm.llm_engine.engine_core.engine_core
    state = core.tokenflow_state() if stats is not None else None  # the replica's utility call
    limits = (sched.max_num_running_reqs, sched.kv_cache_config.num_blocks)
    leftovers = (len(getattr(sched, "held", {})), len(getattr(sched, "released", {})), len(sched.requests))
    if stats is not None:
        assert state["stats"]["pauses_release"] == stats.pauses_release
        assert state["running"] == state["paused_hold"] == state["paused_release"] == 0
    del llm
    gc.collect()
    return tokens, stats, limits, leftovers


@pytest.fixture(scope="module")
def baseline():
    tokens, _, _, _ = generate()
    assert all(len(t) == 96 for t in tokens)
    return tokens


@pytest.mark.parametrize("policy", ["tokenflow", "andes"])
def test_burst_outputs_equal_vllm_scheduler(baseline, policy):
    tokens, stats, (max_seqs, blocks), leftovers = generate(TF, {**FAST, "policy": policy})
    assert stats.pauses_release > 0, "the burst must force KV-releasing pauses"
    if policy == "tokenflow":
        assert stats.pauses_hold > 0
    assert stats.resumes > 0
    # Without offload, released requests recompute their KV on resume.
    assert stats.resumed_after_release > 0 and stats.tokens_recomputed > 0
    assert tokens == baseline  # every request: exactly vLLM's own tokens
    assert stats.max_running <= max_seqs
    assert stats.max_blocks_used <= blocks
    assert leftovers == (0, 0, 0), "nothing parked or leaked after the burst"


class ClaimsStaleKV:
    """Negative control: a pause that frees blocks but keeps claiming the
    computed tokens, so the resumed request reads KV it no longer owns."""

    def _preempt_request(self, request, timestamp, **kw):
        n = request.num_computed_tokens
        super()._preempt_request(request, timestamp, **kw)
        if request.request_id in self.readers:
            request.num_computed_tokens = n - n % self.block_size
            type(self).broken_releases += 1

    broken_releases = 0  # by TokenFlow's release or vLLM's own preemption


def test_broken_resume_is_caught(baseline):
    from tokenflow.engine import scheduler as sched_mod

    broken = type("BrokenTokenFlowScheduler", (ClaimsStaleKV, sched_mod.TokenFlowScheduler), {})
    sched_mod.BrokenTokenFlowScheduler = broken  # importable by dotted path
    try:
        tokens, stats, _, _ = generate("tokenflow.engine.scheduler.BrokenTokenFlowScheduler", FAST)
    finally:
        del sched_mod.BrokenTokenFlowScheduler
    assert broken.broken_releases > 0
    assert tokens != baseline


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def step_until(engine, clock, cond, max_steps=400, dt=0.01):
    outs = {}
    for _ in range(max_steps):
        clock.t += dt
        for o in engine.step():
            outs[o.request_id] = o
        if cond(outs):
            return outs
    raise AssertionError("condition not reached")


@pytest.fixture()
def small_engine():
    """Four sequence slots, injected clock: the burst below must queue."""
    llm = make_llm(TF, {"dt": 0.05}, max_num_seqs=4)
    sched = scheduler_of(llm)
    clock = FakeClock()
    sched.clock = clock
    yield llm.llm_engine, sched, clock
    del llm
    gc.collect()


def test_newcomer_served_while_large_buffers_pause(small_engine):
    engine, sched, clock = small_engine
    for i in range(4):
        engine.add_request(f"old{i}", f"old reader {i} stream", greedy(n=400, rate=5.0))
    # 40 steps at 10 ms: ~40 tokens each against 0.4 s * 5 tok/s read.
    step_until(engine, clock, lambda o: all(len(o.get(f"old{i}", None).outputs[0].token_ids) >= 40
                                            for i in range(4) if f"old{i}" in o) and len(o) == 4)
    engine.add_request("new", "a newcomer arrives", greedy(n=8, rate=5.0))
    t_new = clock.t
    outs = step_until(engine, clock, lambda o: "new" in o and o["new"].outputs[0].token_ids, max_steps=60)
    assert clock.t - t_new <= 0.2  # first token within a few intervals, not after 360 more tokens
    assert sched.tf_stats.pauses_hold + sched.tf_stats.pauses_release >= 1
    # The paused old request resumes before its reader runs dry.
    step_until(engine, clock, lambda o: not sched.held and not sched.released, max_steps=200)
    for i in range(4):
        assert sched.readers[[k for k in sched.readers if k.startswith(f"old{i}")][0]].stall_time(clock.t) == 0.0
    for rid in [f"old{i}" for i in range(4)]:
        engine.abort_request([rid])
    assert outs


def test_abort_paused_request_frees_it(small_engine):
    engine, sched, clock = small_engine
    for i in range(4):
        engine.add_request(f"old{i}", f"old reader {i} stream", greedy(n=400, rate=5.0))
    step_until(engine, clock, lambda o: len(o) == 4 and all(len(x.outputs[0].token_ids) >= 40 for x in o.values()))
    engine.add_request("new", "a newcomer arrives", greedy(n=300, rate=5.0))
    step_until(engine, clock, lambda o: bool(sched.held or sched.released), max_steps=60)
    parked = next(iter(sched.held or sched.released))
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    user_id = next(f"old{i}" for i in range(4) if parked.startswith(f"old{i}"))
    engine.abort_request([user_id])
    step_until(engine, clock, lambda o: parked not in sched.requests, max_steps=5)
    assert parked not in sched.held and parked not in sched.released and parked not in sched.readers
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() >= free_before
    for rid in ["old0", "old1", "old2", "old3", "new"]:
        engine.abort_request([rid])
    step_until(engine, clock, lambda o: not sched.requests, max_steps=5)
    assert sched.get_num_unfinished_requests() == 0


def test_fcfs_control_newcomer_waits():
    """Control for the test above: vLLM's own policy keeps the slots busy."""
    llm = make_llm(TF, {"policy": "fcfs"}, max_num_seqs=4)
    engine, clock = llm.llm_engine, FakeClock()
    scheduler_of(llm).clock = clock
    for i in range(4):
        engine.add_request(f"old{i}", f"old reader {i} stream", greedy(n=400, rate=5.0))
    step_until(engine, clock, lambda o: len(o) == 4 and all(len(x.outputs[0].token_ids) >= 40 for x in o.values()))
    engine.add_request("new", "a newcomer arrives", greedy(n=8, rate=5.0))
    with pytest.raises(AssertionError, match="not reached"):
        step_until(engine, clock, lambda o: "new" in o and o["new"].outputs[0].token_ids, max_steps=60)
    engine.abort_request([f"old{i}" for i in range(4)] + ["new"])
    del llm
    gc.collect()
