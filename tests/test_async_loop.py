"""TokenFlow on vLLM's GPU engine loop (async scheduling, two batches in
flight), driven on CPU by tests/vllm_loop.py: vLLM's real scheduler, KV
cache manager and `EngineCore.step_with_batch_queue`, with a deterministic
stand-in for the model runner that reads its context back from KV blocks."""

from __future__ import annotations

import random

import pytest

from tests.vllm_loop import FAST, TF_ASYNC, TF_SYNC, Burst, make_loop, run_burst, ttft_steps
from tokenflow.core.policy import BY_PRIORITY, GUARDED, KEEP_RUNNING, MUST_RESUME, OUTLASTS, SENT_AHEAD

BURST = Burst()
TAIL = [f"r{i}" for i in range(BURST.requests, BURST.requests + BURST.late)]


def finished_clean(loop) -> None:
    """Everything done, every KV block back in the pool, nothing parked."""
    sched = loop.scheduler
    total = sched.kv_cache_manager.block_pool.num_gpu_blocks
    assert loop.free_blocks() == total - 1  # all but vLLM's null block
    assert not sched.requests and not sched.running and not sched.waiting
    assert not getattr(sched, "held", {}) and not getattr(sched, "released", {})
    assert not getattr(sched, "deferred", {})
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
    def readers_match_clients(lp):
        # Each reader the scheduler ranks by has had exactly the tokens its
        # client has received, pauses and steps in flight notwithstanding.
        for rid, reader in lp.scheduler.readers.items():
            assert reader.delivered == len(lp.tokens[rid]), rid

    loop = run_burst(make_loop(TF_ASYNC, {**FAST, "policy": policy}), BURST, readers_match_clients)
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


def test_overload_fallback_under_async(stock):
    """Readers needing more than the engine decodes: the FCFS fallback
    returns every paused request, in arrival order, under async too."""
    seen = {}

    def overload_midway(loop):
        sched = loop.scheduler
        if "parked" not in seen and sched.held and sched.released:
            seen["parked"] = set(sched.held) | set(sched.released)
            sched.policy.cfg.overload_factor = 1e-6  # every reader now "needs" more than capacity
        elif "parked" in seen and "back" not in seen and not (seen["parked"] & (set(sched.held) | set(sched.released))):
            seen["back"] = loop.step_no

    loop = run_burst(make_loop(TF_ASYNC, {**FAST}), BURST, on_step=overload_midway)
    s = loop.scheduler.tf_stats
    assert seen.get("parked") and s.fallbacks > 0
    assert "back" in seen  # every request paused before the overload came back to run
    assert loop.tokens == stock.tokens
    finished_clean(loop)


def test_working_set_bounds_admission(stock):
    """Newcomers beyond the working set (no host tier, device KV for about
    a dozen requests) are kept out of vLLM's queue until the next decision,
    so a slot freed in between does not admit them; all still finish."""
    seen = {"deferring_steps": 0, "max_active": 0}

    def check(loop):
        sched = loop.scheduler
        queued = {r.request_id for r in sched.waiting} | {r.request_id for r in sched.running}
        assert not set(sched.deferred) & queued
        if sched.deferred:
            seen["deferring_steps"] += 1

    loop = run_burst(make_loop(TF_ASYNC, {**FAST, "recompute_overcommit": 0.0}, num_blocks=120), BURST,
                     on_step=check)
    assert seen["deferring_steps"] > 0
    assert loop.tokens == stock.tokens
    finished_clean(loop)


@pytest.mark.parametrize("unread_s", [0.05, 30.0])
def test_a_continued_stream_is_ranked_by_its_readers_buffer(stock, unread_s):
    """A stream continued from a lost engine (tokenflow/serve/continuation.py)
    arrives with the burst's tail: its prompt holds the ids already sent
    and `vllm_xargs` its reader's unread tokens. Under the GPU loop its
    first token comes before every other late newcomer's when that buffer
    is about to run dry, and after some of theirs when it holds plenty; its
    tokens are what the lost engine would have gone on to generate."""
    from tokenflow.core.config import CARRIED_KEY, WAITED_KEY

    # A tail of 24: more than one wave of first tokens (ranked as a newcomer,
    # the continuation came in the second wave).
    burst = Burst(late=24)
    rid, prompt, n, rate = next(iter(burst.items()))
    sent = stock.tokens[rid][:40]  # the stand-in model's tokens depend on the context only

    def add_continuation(loop):
        if loop.step_no == burst.late_after_steps:
            loop.add("cont", prompt + sent, n - len(sent), rate,
                     extra={CARRIED_KEY: unread_s * rate, WAITED_KEY: 3.0})

    loop = run_burst(make_loop(TF_ASYNC, {**FAST}), burst, on_step=add_continuation)
    assert loop.tokens["cont"] == stock.tokens[rid][len(sent):]
    tail = [f"r{i}" for i in range(burst.requests, burst.requests + burst.late)]
    cont, others = ttft_steps(loop, ["cont"])[0], ttft_steps(loop, tail)
    if unread_s < 1:
        assert cont <= others[0], (cont, others)
    else:
        assert cont > others[len(others) // 2], (cont, others)
    finished_clean(loop)


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
        self._resume(list(self.released))


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
    from tokenflow.engine import scheduler as sched_mod

    name = "Test" + "".join(m.__name__ for m in mixins)
    setattr(sched_mod, name, type(name, (*mixins, sched_mod.TokenFlowAsyncScheduler), {}))
    return f"tokenflow.engine.scheduler.{name}"


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


def stream(loop, steps: int, every: int, prompt: tuple[int, int], seed: int = 5) -> list[tuple[int, int]]:
    """A request every `every` steps, prompts of random length; the
    (decode, prefill) tokens of each step."""
    rng, shapes = random.Random(seed), []
    for i in range(steps):
        if i % every == 0:
            loop.add(f"s{i}", [rng.randrange(10, 4000) for _ in range(rng.randint(*prompt))], 40, 10.0)
        loop.step()
        shapes.append(loop.runner.last_shape[:2])
    return shapes


def true_capacity(loop) -> float:
    cost, b = loop.core.model_executor.step_cost, loop.scheduler.meters.max_decode_batch
    return b / (cost.base_s + cost.decode_s * b)


def test_meters_when_no_step_is_decode_only():
    """A steady stream with room for all keeps prefill in every step and
    fills the token budget, as chunked prefill does on a GPU. The old
    meters, fed by decode-only steps, knew no capacity at all here; now the
    capacity is the decode rate at the current prefill load: a lower bound
    of the true one, and close to it."""
    loop = make_loop(TF_ASYNC, {**FAST}, max_num_batched_tokens=128, max_num_seqs=128, num_blocks=4000)
    shapes = stream(loop, 600, every=1, prompt=(10, 200))
    assert not any(d and not p for d, p in shapes)
    m = loop.scheduler.meters
    assert m.max_decode_batch > 16
    assert 0.8 * true_capacity(loop) <= m.decode_capacity <= true_capacity(loop) * 1.001
    assert m.prefill_speed is not None


def test_meters_separate_decode_and_prefill_costs_on_mixed_steps():
    loop = make_loop(TF_ASYNC, {**FAST}, max_num_batched_tokens=128, num_blocks=2000)
    shapes = stream(loop, 600, every=2, prompt=(50, 400))
    assert sum(1 for d, p in shapes if d and p) > len(shapes) / 2  # most steps mix both
    m, cost = loop.scheduler.meters, loop.core.model_executor.step_cost
    assert m.decode_capacity == pytest.approx(true_capacity(loop), rel=0.05)
    assert m.prefill_speed == pytest.approx(1 / cost.prefill_s, rel=0.1)
    assert 1 / m.step_rate.value > cost.base_s


@pytest.mark.parametrize("start_s", [0.0, 0.001])
def test_meters_measure_what_a_request_added_to_the_batch_costs(start_s):
    """Each request the runner adds to its batch (a newcomer, or a paused
    one back) may cost its step a fixed time beyond its tokens; the policy
    prices a swap with it. The meters find that time, and find none where
    there is none."""
    loop = make_loop(TF_ASYNC, {**FAST}, max_num_batched_tokens=128, num_blocks=2000)
    loop.core.model_executor.step_cost.start_s = start_s
    stream(loop, 600, every=2, prompt=(50, 400))
    measured = loop.scheduler.meters.start_seconds
    if start_s:
        assert measured == pytest.approx(start_s, rel=0.1)
    else:
        assert measured is None or measured < 1e-5


def light_stream(loop, n: int = 60, mean_gap_steps: float = 40.0, seed: int = 1):
    """Poisson arrivals (in steps) at about a fifth of the slots' capacity:
    nothing needs to wait."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n):
        arrivals.append(int(t))
        t += rng.expovariate(1.0 / mean_gap_steps)
    items = [(f"l{i}", [rng.randrange(10, 4000) for _ in range(rng.randint(20, 80))], 120,
              rng.choice((3.0, 5.0, 8.0))) for i in range(n)]
    while items or loop.busy():
        while items and arrivals[n - len(items)] <= loop.step_no:
            loop.add(*items.pop(0))
        loop.step()
    return loop


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_light_load_costs_nothing(async_scheduling):
    """No harm where nothing contends: every request's first token comes in
    the same step as under vLLM's own scheduler, nothing pauses, and the
    policy is never even asked."""
    stock = light_stream(make_loop(None, async_scheduling=async_scheduling))
    tf_cls = TF_ASYNC if async_scheduling else TF_SYNC
    loop = light_stream(make_loop(tf_cls, {**FAST}, async_scheduling=async_scheduling))
    assert max(ttft_steps(stock, stock.tokens)) <= 2  # light indeed: no one queued
    assert loop.first_token_step == stock.first_token_step
    assert loop.tokens == stock.tokens
    s = loop.scheduler.tf_stats
    assert s.pauses_hold == s.pauses_release == s.decisions == 0


def test_decision_trace_records_who_ranked_where(tmp_path, monkeypatch):
    """TOKENFLOW_TRACE_DIR: one line per decision, every request the policy
    saw with its rank key, and what was decided (tokenflow/engine/trace.py)."""
    import json

    monkeypatch.setenv("TOKENFLOW_TRACE_DIR", str(tmp_path))
    loop = run_burst(make_loop(TF_ASYNC, FAST), BURST)
    loop.scheduler._trace.close()
    [path] = tmp_path.glob("decisions-*.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    decided = [x for x in lines if x["decided"]]
    assert len(decided) == loop.scheduler.tf_stats.decisions > 0
    assert sum(len(x["pause_hold"]) + len(x["pause_release"]) for x in decided) >= \
        loop.scheduler.tf_stats.pauses_hold + loop.scheduler.tf_stats.pauses_release
    seen = {row[0] for x in lines for row in x["requests"]}
    assert {f"r{i}" for i in range(BURST.requests)} <= seen  # every request of the burst was ranked
    tiers = (KEEP_RUNNING, MUST_RESUME, GUARDED, BY_PRIORITY, OUTLASTS, SENT_AHEAD)
    assert all(row[7] in tiers for x in lines for row in x["requests"])  # a tier each (the rank's, work end included)


def test_snapshot_columns_are_each_requests_facts():
    """The snapshot reads fixed facts from the request table and levels from
    the readers' dry_at, at C speed; every few steps of a burst with pauses,
    each row equals what the request and its reader say one by one."""
    import copy

    from tokenflow.core.columns import Phase

    seen = {"rows": 0, "paused": 0}

    def compare(lp):
        sched = lp.scheduler
        if lp.step_no % 7:
            return
        now = sched.clock()
        cols, _ = sched.snapshot(now)
        queued = [r for r in sched.waiting if r.status.name in ("WAITING", "PREEMPTED")]
        groups = ((sched.running, Phase.RUNNING, True), (sched.held.values(), Phase.PAUSED, True),
                  (sched.released.values(), Phase.PAUSED, False), (queued, Phase.WAITING, False))
        expected = []
        for reqs, phase, resident in groups:
            for req in reqs:
                reader = sched.readers[req.request_id]
                n = req.num_tokens
                expected.append((req.request_id, phase, reader.arrival_time, reader.rate,
                                 copy.deepcopy(reader).buffer(now), req.num_output_tokens, req.max_tokens, n,
                                 (n + sched.block_size) // sched.block_size, resident, 0,
                                 reader.first_token_time is not None))
        fields = ("req_id", "phase", "arrival_time", "rate", "buffer_tokens", "num_output", "max_tokens",
                  "num_tokens", "blocks", "kv_resident", "host_blocks", "reading")
        got = [tuple(getattr(v, f) for f in fields) for v in cols.views()]
        assert [g[:4] + g[5:] for g in got] == [e[:4] + e[5:] for e in expected]
        assert [g[4] for g in got] == pytest.approx([e[4] for e in expected], abs=1e-6)
        seen["rows"] += len(got)
        seen["paused"] += sum(g[1] is Phase.PAUSED for g in got)

    run_burst(make_loop(TF_ASYNC, {**FAST, "policy": "tokenflow"}), BURST, compare)
    assert seen["rows"] > 0 and seen["paused"] > 0


def test_request_table_reuses_rows_and_grows():
    import numpy as np

    from tokenflow.engine.request_table import RequestTable

    table = RequestTable(capacity=2)
    for i in range(5):
        table.add(f"r{i}", float(i), 10.0 + i, 100 + i, 20 + i)
    table.remove("r1")
    table.add("r5", 5.0, 15.0, 105, 25)
    assert len(table) == 5 and table.row_of["r5"] == 1  # r1's row, again
    rows = table.rows(["r4", "r0", "r5"])
    assert table.rate[rows].tolist() == [14.0, 10.0, 15.0]
    assert table.max_tokens[rows].tolist() == [104, 100, 105] and table.num_prompt[rows].tolist() == [24, 20, 25]
    assert np.array_equal(table.arrival_time[rows], [4.0, 0.0, 5.0])


def test_past_capacity_first_tokens_come_sooner_and_more_tokens_count():
    """128 readers at once on 64 slots of vLLM's real scheduler, needing
    1.4x what a full batch decodes (the fake clock's capacity is exact,
    as on a GPU): the issue's 1.4x targets on the fake clock, the same
    figures every run. TokenFlow serves the last first tokens in under a
    quarter of stock's wait (stock's second half waits for the first to
    finish: newcomers go ahead of readers with something to read), half
    as many again of the tokens it sends land while their readers need
    them, and it decodes at least 0.95x stock's tokens/s."""
    from tests.vllm_loop import effective_burst

    rows = {r["scheduler"]: r for r in effective_burst(1.4)}
    stock, tf = rows["stock"], rows["tokenflow"]
    assert tf["ttft_p99_s"] < 0.25 * stock["ttft_p99_s"], rows
    assert tf["effective_per_s"] > 1.5 * stock["effective_per_s"], rows
    assert tf["tokens_per_s"] > 0.95 * stock["tokens_per_s"], rows


def test_a_batch_that_finishes_between_decisions_is_refilled_from_the_held():
    """128 readers of one rate on 64 slots, needing 0.6x what a full batch
    decodes: TokenFlow serves them in turns, so a whole batch finishes
    between two decisions while the other half waits, held. Their slots go
    to the held at once, in the decision's order, so TokenFlow decodes as
    fast as stock (the engine sat idle until the next decision before: 2.4%
    fewer tokens a second)."""
    from tests.vllm_loop import effective_burst

    rows = {r["scheduler"]: r for r in effective_burst(0.6, mix=((1, 1.0),))}
    assert rows["tokenflow"]["tokens_per_s"] >= 0.995 * rows["stock"]["tokens_per_s"], rows
    assert rows["tokenflow"]["ttft_p99_s"] < 0.25 * rows["stock"]["ttft_p99_s"], rows


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_slots_freed_between_decisions_go_to_held_readers_and_outputs_equal(async_scheduling):
    """Requests that finish between decisions (every 0.5 s here) free
    their slots; held readers take them in the decision's order at once,
    under async scheduling only once their last step's output is in, and
    every client still gets stock's tokens. The engine does not sit idle
    while readers are parked."""
    burst = Burst(requests=48, late=0, late_after_steps=0, max_tokens=160, rates=(10.0,))
    stock = run_burst(make_loop(None, async_scheduling=async_scheduling), burst)
    sched_cls = TF_ASYNC if async_scheduling else TF_SYNC
    loop = make_loop(sched_cls, {"dt": 0.5}, async_scheduling=async_scheduling)
    decisions, refilled, last = [0], [0], {"held": set(), "decisions": 0}
    decide = loop.scheduler._reschedule

    def counting(now):
        decisions[0] += 1
        decide(now)

    loop.scheduler._reschedule = counting  # a probe: when decisions happen

    def on_step(lp):
        s = lp.scheduler
        if last["decisions"] == decisions[0]:  # no decision in the step just taken
            back = [r for r in last["held"] if r not in s.held and r in s.requests]
            assert all(s.requests[r] in s.running for r in back), back
            refilled[0] += len(back)
        last.update(held=set(s.held), decisions=decisions[0])

    run_burst(loop, burst, on_step)
    assert loop.tokens == stock.tokens
    assert refilled[0] > 0
    # Steps with nothing to run: stock's last ones, and under async the
    # step already scheduled when a whole batch finishes. Before, the
    # engine idled until the next decision: 2.5% (async) and 11% (sync)
    # of the run.
    cost = loop.core.model_executor.step_cost
    assert cost.idle_steps * cost.idle_s < 0.01 * loop.clock.t, cost
    finished_clean(loop)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_released_requests_reload_from_the_fake_host_tier_and_outputs_equal(stock, async_scheduling):
    """With a host tier in the loop (tests/fake_host_tier.py), a request
    TokenFlow released gets its full blocks back from the host's copy and
    vLLM recomputes only its tail, as with the offloading connector on a
    GPU; every client still gets stock's tokens."""
    from tests.vllm_loop import BLOCK

    sched_cls = TF_ASYNC if async_scheduling else TF_SYNC
    loop = run_burst(make_loop(sched_cls, {**FAST}, async_scheduling=async_scheduling, host_tier=True), BURST)
    st = loop.scheduler.tf_stats
    assert st.resumed_after_release > 0 and loop.scheduler.connector.tokens_loaded > 0
    assert st.tokens_recomputed <= st.resumed_after_release * BLOCK  # tails only
    assert loop.tokens == stock.tokens
    finished_clean(loop)


def test_a_wrong_load_from_the_fake_host_tier_is_caught(stock, monkeypatch):
    """The tier's loads write the host's copy into the request's new
    blocks; one that restores a position from the wrong slot changes the
    tokens the client gets."""
    from tests.vllm_loop import MirrorRunner

    load = MirrorRunner._load

    def shifted(self, rid, start, n):
        load(self, rid, start, n)
        pos, bs = start + n - 1, self.block_size
        self.kv[self.reqs[rid].blocks[pos // bs]][pos % bs] = self.host[rid][pos - 1]

    monkeypatch.setattr(MirrorRunner, "_load", shifted)
    loop = run_burst(make_loop(TF_SYNC, {**FAST}, async_scheduling=False, host_tier=True), BURST)
    assert loop.scheduler.connector.tokens_loaded > 0
    assert loop.tokens != stock.tokens
