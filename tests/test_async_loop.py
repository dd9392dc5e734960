"""TokenFlow on vLLM's GPU engine loop (async scheduling, two batches in
flight), driven on CPU by tests/vllm_loop.py: vLLM's real scheduler, KV
cache manager and `EngineCore.step_with_batch_queue`, with a deterministic
stand-in for the model runner that reads its context back from KV blocks."""

from __future__ import annotations

import random

import pytest

from tests.vllm_loop import FAST, TF_ASYNC, TF_SYNC, Burst, make_loop, run_burst, ttft_steps

BURST = Burst()
TAIL = [f"r{i}" for i in range(BURST.requests, BURST.requests + BURST.late)]


def finished_clean(loop) -> None:
    """Everything done, every KV block back in the pool, nothing parked."""
    sched = loop.scheduler
    total = sched.kv_cache_manager.block_pool.num_gpu_blocks
    assert loop.free_blocks() == total - 1  # all but vLLM's null block
    assert not sched.requests and not sched.running and not sched.waiting
    assert not getattr(sched, "held", {}) and not getattr(sched, "released", {})
    assert not getattr(sched, "readers", {})


@pytest.fixture(scope="module")
def stock():
    loop = run_burst(make_loop(None), BURST)
    assert all(len(t) == BURST.max_tokens for t in loop.tokens.values())
    finished_clean(loop)
    return loop


def test_harness_async_equals_sync(stock):
    """The stand-in runner is faithful: vLLM's sync and async loops give
    the same tokens through it."""
    sync = run_burst(make_loop(None, async_scheduling=False), BURST)
    assert sync.tokens == stock.tokens


@pytest.mark.parametrize("policy", ["tokenflow", "andes"])
def test_burst_pauses_under_async_and_outputs_equal(stock, policy):
    loop = run_burst(make_loop(TF_ASYNC, {**FAST, "policy": policy}), BURST)
    s = loop.scheduler.tf_stats
    assert loop.core.batch_queue_size == 2 and loop.scheduler.scheduler_config.async_scheduling
    assert s.pauses_release > 0
    if policy == "tokenflow":
        assert s.pauses_hold > 0
    # The pauses were applied with a step in flight (the async case).
    assert s.pauses_in_flight > 0
    assert s.pauses_skipped == 0
    assert s.resumes > 0
    assert loop.tokens == stock.tokens  # every request, token for token
    assert all(r.startswith("FinishReason.LENGTH") or r == "length" for r in loop.finished.values())
    finished_clean(loop)
    tail_stock = max(ttft_steps(stock, TAIL))
    tail = max(ttft_steps(loop, TAIL))
    if policy == "tokenflow":
        assert tail <= tail_stock / 4, (tail, tail_stock)
    else:
        assert tail < tail_stock, (tail, tail_stock)


def test_sync_loop_still_pauses_and_matches(stock):
    loop = run_burst(make_loop(TF_SYNC, {**FAST}, async_scheduling=False), BURST)
    s = loop.scheduler.tf_stats
    assert s.pauses_hold > 0 and s.pauses_release > 0 and s.pauses_in_flight == 0
    assert loop.tokens == stock.tokens
    finished_clean(loop)


def test_abort_running_held_and_released_under_async(stock):
    aborted: dict[str, str] = {}

    def abort_one_of_each(loop):
        sched = loop.scheduler
        if aborted or not (sched.held and sched.released and sched.running):
            return
        aborted["held"] = next(iter(sched.held))
        aborted["released"] = next(iter(sched.released))
        aborted["running"] = next(r.request_id for r in sched.running if r.num_output_tokens)
        # Both parked ones were paused with a step in flight moments ago
        # or have one landing now; abort all three between two steps.
        loop.abort(list(aborted.values()))

    loop = run_burst(make_loop(TF_ASYNC, {**FAST}), BURST, on_step=abort_one_of_each)
    assert set(aborted) == {"held", "released", "running"}
    for rid in aborted.values():
        got, full = loop.tokens[rid], stock.tokens[rid]
        assert 0 < len(got) < len(full) and got == full[:len(got)]
    for rid, toks in loop.tokens.items():
        if rid not in aborted.values():
            assert toks == stock.tokens[rid]
    finished_clean(loop)


class ResumesAtOnce:
    """Puts every released request straight back in the step it was
    released, while its last step is still in flight (vLLM itself also
    refuses to admit a request whose stale output is still to land)."""

    def _apply(self, d, now):
        super()._apply(d, now)
        self._resume(list(self.released), [])


class MarksPausedInFlight:
    """Remembers which requests a decision paused with a step in flight."""

    def _apply(self, d, now):
        before = set(self.held) | set(self.released)
        super()._apply(d, now)
        self._marked = {r for r in (set(self.held) | set(self.released)) - before
                        if self.requests[r].num_in_flight_tokens}

    def update_from_output(self, scheduler_output, model_runner_output):
        outs = super().update_from_output(scheduler_output, model_runner_output)
        marked, self._marked = getattr(self, "_marked", set()), set()
        for eco in outs.values():
            for o in eco.outputs:
                if o.request_id in marked and o.new_token_ids:
                    self.fault(o)
        return outs


class DropsInFlightToken(MarksPausedInFlight):
    """Negative control: the token of the step in flight at the pause never
    reaches the client."""

    def fault(self, o):
        o.new_token_ids = []


class DuplicatesInFlightToken(MarksPausedInFlight):
    """Negative control: the token of the step in flight at the pause is
    recorded twice (in the request's context and in the stream)."""

    def fault(self, o):
        req = self.requests.get(o.request_id)
        if req is not None and not req.is_finished():
            req.append_output_token_ids(o.new_token_ids)
            o.new_token_ids = o.new_token_ids * 2


def variant(*mixins):
    from tokenflow import scheduler as sched_mod

    name = "Test" + "".join(m.__name__ for m in mixins)
    setattr(sched_mod, name, type(name, (*mixins, sched_mod.TokenFlowAsyncScheduler), {}))
    return f"tokenflow.scheduler.{name}"


def test_same_step_resume_waits_for_in_flight_step(stock):
    loop = run_burst(make_loop(variant(ResumesAtOnce), {**FAST}), BURST)
    assert loop.scheduler.tf_stats.resumes_delayed > 0
    assert loop.tokens == stock.tokens
    finished_clean(loop)


@pytest.mark.parametrize("fault", [DuplicatesInFlightToken, DropsInFlightToken])
def test_broken_in_flight_handling_is_caught(stock, fault):
    loop = run_burst(make_loop(variant(fault), {**FAST}), BURST)
    assert loop.scheduler.tf_stats.pauses_in_flight > 0
    assert loop.tokens != stock.tokens


def test_meters_work_when_decode_only_steps_are_rare():
    """Long prompts in small chunks keep prefill in nearly every step, as
    chunked prefill does on a GPU; the decode capacity and prefill speed
    still come out near the stand-in's true step costs."""
    loop = make_loop(TF_ASYNC, {**FAST}, max_num_batched_tokens=96, num_blocks=2000)
    rng = random.Random(5)
    shapes = []
    for i in range(800):
        if i % 4 == 0:
            loop.add(f"s{i}", [rng.randrange(10, 4000) for _ in range(500)], 40, 10.0)
        loop.step()
        shapes.append(loop.runner.last_shape)
    decode_only = sum(1 for d, p in shapes if d and not p)
    assert decode_only < 0.05 * len(shapes)
    m = loop.scheduler.meters
    cost = loop.core.model_executor.step_cost
    b = m.max_decode_batch
    assert b > 4
    true_capacity = b / (cost.base_s + cost.decode_s * b)
    assert m.decode_capacity == pytest.approx(true_capacity, rel=0.1)
    assert m.prefill_speed == pytest.approx(1 / cost.prefill_s, rel=0.2)
