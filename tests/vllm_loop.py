"""vLLM's GPU engine loop, run on CPU without a model.

The scheduler under test is vLLM's real one (or ours on top of it), with
vLLM's real KV cache manager, driven by vLLM's own `EngineCore.step` or
`EngineCore.step_with_batch_queue` (two batches in flight: `schedule()` of
step N+1 runs before `update_from_output()` of step N). Only the model
executor is a stand-in, `MirrorRunner`:

- it keeps per-request state the way vLLM's V1 GPU model runner does under
  async scheduling: it appends its own sampled token at once (the scheduler
  learns it a step later), drops requests that a step leaves out from its
  persistent batch, and re-reads their output tokens from the scheduler's
  `all_token_ids` when they come back;
- it writes each scheduled token into the KV block the scheduler assigned,
  and the next token is a pure function of the context *read back from
  those blocks*. A request that reads KV it does not own, misses a token or
  holds one twice gets a different continuation, so token-for-token
  equality with the stock scheduler is a real check;
- with `make_loop(host_tier=True)` the scheduler has a host KV tier
  (tests/fake_host_tier.py): a released request's full blocks come back
  from the runner's host copy of them and only its tail is recomputed.

Run `python -m tests.vllm_loop` for the burst table of stock, TokenFlow and
Andes schedulers (pauses and TTFT in steps); `--decision-time` and
`--step-overhead` time TokenFlow's decision and its per-step bookkeeping;
`--burst-throughput` gives a burst's raw throughput on the fake clock, and
`--effective [LOAD] [--no-tier] [--tokenflow JSON]` a burst's effective
throughput (where its readers' weight is lost) on it.
"""

from __future__ import annotations

import queue
import random
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

VOCAB = 4000  # tokens the stand-in model emits (ids 10..VOCAB+9)
BLOCK = 16


@dataclass
class RunnerRequest:
    tokens: list[int]  # prompt + outputs, as this runner knows them
    num_prompt: int
    blocks: list[int]
    num_computed: int = 0


class MirrorRunner:
    """A deterministic model behind vLLM's runner bookkeeping (see module doc)."""

    def __init__(self, block_size: int, async_scheduling: bool):
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.reqs: dict[str, RunnerRequest] = {}
        self.batch: set[str] = set()  # vLLM's persistent batch
        self.kv: dict[int, list[int | None]] = {}  # block id -> token at each slot
        self.steps = 0
        self.last_shape = (0, 0, 0)  # decode tokens, prefill tokens, requests added to the batch
        self._added = 0
        self.tier = None  # tests.fake_host_tier.FakeHostTier, the scheduler's connector, when the loop has one
        self.host: dict[str, list[int | None]] = {}  # request id -> its full blocks' KV, copied to the host

    def execute(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
            self.host.pop(rid, None)
            self.batch.discard(rid)
        cached = so.scheduled_cached_reqs
        # Left out of this step, or resumed after preemption: out of the batch.
        for rid in list(self.batch):
            if rid not in so.num_scheduled_tokens or rid in cached.resumed_req_ids:
                self.batch.discard(rid)
        self._added = len(so.scheduled_new_reqs)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = RunnerRequest(list(new.prompt_token_ids), len(new.prompt_token_ids),
                                                  list(new.block_ids[0]), new.num_computed_tokens)
            self.batch.add(new.req_id)
        for i, rid in enumerate(cached.req_ids):
            self._update_cached(rid, i, cached)
        for rid, (start, n) in getattr(so.kv_connector_metadata, "loads", {}).items():
            self._load(rid, start, n)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.steps += 1
        ids, sampled, decode, prefill = [], [], 0, 0
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            sampled.append(self._forward(rid, n))
            if n == 1:
                decode += 1
            else:
                prefill += n
        self.last_shape = (decode, prefill, self._added)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)

    def _update_cached(self, rid: str, i: int, cached) -> None:
        st = self.reqs[rid]
        st.num_computed = cached.num_computed_tokens[i]
        new_blocks = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids:
            st.blocks = list(new_blocks[0])
        elif new_blocks is not None:
            st.blocks.extend(new_blocks[0])
        if rid not in self.batch:
            # As the GPU runner: under async scheduling its own cache of a
            # request that left the batch may be short or stale, so the
            # output tokens come from the scheduler's full list.
            n_out = cached.num_output_tokens[i]
            if self.async_scheduling and n_out > 0:
                st.tokens = st.tokens[:st.num_prompt] + list(cached.all_token_ids[rid][-n_out:])
            self.batch.add(rid)
            self._added += 1
        else:
            # Sync scheduling: a running request's cache may lack nothing.
            del st.tokens[st.num_prompt + cached.num_output_tokens[i]:]

    def _forward(self, rid: str, n: int) -> list[int]:
        st, bs = self.reqs[rid], self.block_size
        start, end = st.num_computed, st.num_computed + n
        if end > len(st.tokens):
            raise AssertionError(f"{rid}: scheduled up to {end} tokens, runner knows {len(st.tokens)}")
        for pos in range(start, end):
            block = self.kv.setdefault(st.blocks[pos // bs], [None] * bs)
            block[pos % bs] = st.tokens[pos]
        if self.tier is not None:
            self._write_through(rid, end)
        if end < len(st.tokens):
            return []  # a prefill chunk: no token sampled
        full, rest = divmod(end, bs)
        ctx = [tuple(self.kv[b]) for b in st.blocks[:full]]
        if rest:
            ctx.append(tuple(self.kv[st.blocks[full]][:rest]))
        token = 10 + hash((end, tuple(ctx))) % VOCAB
        st.tokens.append(token)
        return [token]

    def _write_through(self, rid: str, computed: int) -> None:
        """Copy the request's newly full blocks, as read from the KV, to the host."""
        st, bs, host = self.reqs[rid], self.block_size, self.host.setdefault(rid, [])
        for pos in range(len(host), computed // bs * bs):
            host.append(self.kv[st.blocks[pos // bs]][pos % bs])
        self.tier.on_host[rid] = len(host)

    def _load(self, rid: str, start: int, n: int) -> None:
        """Restore positions [start, start + n) from the host into the
        blocks the scheduler gave the request."""
        st, bs, host = self.reqs[rid], self.block_size, self.host[rid]
        for pos in range(start, start + n):
            self.kv.setdefault(st.blocks[pos // bs], [None] * bs)[pos % bs] = host[pos]


class MirrorExecutor:
    """What EngineCore calls on its executor, answered by MirrorRunner. A
    step's time passes (on the fake clock) when EngineCore waits for its
    output, as it would on a GPU: under async scheduling the next step is
    scheduled before that wait."""

    def __init__(self, runner: MirrorRunner, step_cost):
        self.runner = runner
        self.step_cost = step_cost  # (decode tokens, prefill tokens, requests added) -> None
        self._sampled = None

    def execute_model(self, scheduler_output, non_block: bool = False):
        out = self.runner.execute(scheduler_output)
        # The GPU runner returns None when sampling follows (sample_tokens).
        result = None if scheduler_output.total_num_scheduled_tokens else out
        if result is not None:  # nothing scheduled: an idle round of the loop
            self.step_cost(0, 0)
        self._sampled = (out, self.runner.last_shape)
        return _StepFuture(result) if non_block else result

    def sample_tokens(self, grammar_output, non_block: bool = False):
        (out, shape), self._sampled = self._sampled, None
        if non_block:
            return _StepFuture(out, lambda: self.step_cost(*shape))
        self.step_cost(*shape)
        return out


class _StepFuture(Future):
    """A finished future whose first result() lets the step's time pass."""

    def __init__(self, value, on_wait=None):
        super().__init__()
        self.set_result(value)
        self._on_wait = on_wait

    def result(self, timeout=None):
        if self._on_wait is not None:
            wait, self._on_wait = self._on_wait, None
            wait()
        return super().result(timeout)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class StepCost:
    """Model step time: fixed cost plus per-token costs, on a fake clock."""

    clock: FakeClock
    base_s: float = 0.004
    decode_s: float = 0.0002
    prefill_s: float = 0.00002
    start_s: float = 0.0  # per request the runner adds to its batch
    # A step with nothing scheduled: the engine's busy loop goes round (on
    # a GPU too) while requests are parked; time passes, no token comes.
    idle_s: float = 0.001
    idle_steps: int = 0

    def __call__(self, decode: int, prefill: int, added: int = 0) -> None:
        if not decode + prefill:
            self.clock.t += self.idle_s
            self.idle_steps += 1
            return
        self.clock.t += self.base_s + self.decode_s * decode + self.prefill_s * prefill + self.start_s * added


@dataclass
class Loop:
    """One engine core: scheduler + mirror runner + vLLM's step function."""

    core: object
    runner: MirrorRunner
    clock: FakeClock
    async_scheduling: bool
    step_no: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)  # what each client received
    first_token_step: dict[str, int] = field(default_factory=dict)
    arrival_step: dict[str, int] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # request id -> finish reason

    @property
    def scheduler(self):
        return self.core.scheduler

    def add(self, rid: str, prompt: list[int], max_tokens: int, rate: float | None = None,
            extra: dict | None = None) -> None:
        """`extra`: more of `SamplingParams.extra_args` (vllm_xargs on the API)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = {**({"consumption_rate": rate} if rate is not None else {}), **(extra or {})} or None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        req = Request(rid, list(prompt), sp, None, arrival_time=self.clock.t,
                      block_hasher=self.core.request_block_hasher)
        self.scheduler.add_request(req)
        self.tokens[rid] = []
        self.arrival_step[rid] = self.step_no

    def step(self) -> None:
        """One call of vLLM's engine step, as its busy loop makes it."""
        core = self.core
        outputs, _ = core.step_with_batch_queue() if self.async_scheduling else core.step()
        self.step_no += 1
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                if o.new_token_ids:
                    self.tokens[o.request_id].extend(o.new_token_ids)
                    self.first_token_step.setdefault(o.request_id, self.step_no)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    def busy(self) -> bool:
        core = self.core
        return core.scheduler.has_requests() or bool(core.batch_queue)

    def run(self, max_steps: int = 20000) -> None:
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def abort(self, rids: list[str]) -> None:
        """As a client disconnect reaches EngineCore between steps."""
        self.core.abort_requests(rids)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def make_loop(scheduler_cls=None, tokenflow: dict | None = None, *, async_scheduling: bool = True,
              num_blocks: int = 200, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
              block_size: int = BLOCK, max_model_len: int = 1024, prefix_caching: bool = True,
              host_tier: bool = False) -> Loop:
    """An EngineCore as vLLM builds it, minus the model executor. With
    `host_tier`, a host KV tier as vLLM's scheduler sees one
    (tests/fake_host_tier.py): a released request gets its full blocks
    back without recomputing them."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from tests.engines import ensure_model, inproc_env

    args = EngineArgs(model=ensure_model(), max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                      enable_prefix_caching=prefix_caching, enable_chunked_prefill=True,
                      enforce_eager=True, skip_tokenizer_init=True, disable_log_stats=True)
    if scheduler_cls is not None:
        args.scheduler_cls = scheduler_cls
        args.additional_config = {"tokenflow": tokenflow or {}}
    with inproc_env():
        config = args.create_engine_config()
    # The CPU platform switches async scheduling off inside VllmConfig; the
    # GPU loop is what this harness stands for.
    config.scheduler_config.async_scheduling = async_scheduling
    if scheduler_cls is None:
        config.scheduler_config.scheduler_cls = None
    if host_tier:
        from vllm.config.kv_transfer import KVTransferConfig

        config.kv_transfer_config = KVTransferConfig(kv_connector="FakeHostTier", kv_role="kv_both",
                                                     kv_connector_module_path="tests.fake_host_tier")
        config.scheduler_config.disable_hybrid_kv_cache_manager = True  # one KV group here
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    config.cache_config.num_gpu_blocks = num_blocks
    sched_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = sched_cls(vllm_config=config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=block_size, log_stats=True)
    clock = FakeClock()
    if hasattr(scheduler, "clock"):
        scheduler.clock = clock
    runner = MirrorRunner(block_size, async_scheduling)
    runner.tier = scheduler.connector if host_tier else None

    core = EngineCore.__new__(EngineCore)  # vLLM's step functions, our executor
    core.vllm_config = config
    core.scheduler = scheduler
    core.model_executor = MirrorExecutor(runner, StepCost(clock))
    core.log_stats = False
    core.is_mm_encoder_only = False
    core.is_pooling_model = False
    core.check_for_draft_tokens = False
    core.async_scheduling = async_scheduling
    core.aborts_queue = queue.Queue()
    core._weight_version = "default"
    core.batch_queue_size = config.max_concurrent_batches
    core.batch_queue = deque(maxlen=core.batch_queue_size) if core.batch_queue_size > 1 else None
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    core.request_block_hasher = get_request_block_hasher(block_size, hash_fn)
    if async_scheduling:
        assert core.batch_queue_size == 2, "the GPU loop keeps two batches in flight"
    return Loop(core, runner, clock, async_scheduling)


@dataclass
class Burst:
    """A burst that overfills sequence slots and KV: `requests` at once,
    then `late` more a few steps later (the burst's tail)."""

    requests: int = 40
    late: int = 8
    late_after_steps: int = 60
    prompt: int = 40
    max_tokens: int = 160
    rates: tuple = (5.0, 10.0, 20.0)
    seed: int = 0

    def items(self):
        rng = random.Random(self.seed)
        for i in range(self.requests + self.late):
            prompt = [rng.randrange(10, VOCAB) for _ in range(self.prompt)]
            yield f"r{i}", prompt, self.max_tokens, rng.choice(self.rates)


def run_burst(loop: Loop, burst: Burst, on_step=None) -> Loop:
    items = list(burst.items())
    for rid, prompt, n, rate in items[:burst.requests]:
        loop.add(rid, prompt, n, rate)
    late = items[burst.requests:]
    for _ in range(20000):
        if loop.step_no == burst.late_after_steps:
            for rid, prompt, n, rate in late:
                loop.add(rid, prompt, n, rate)
        if on_step is not None:
            on_step(loop)
        if not loop.busy() and loop.step_no >= burst.late_after_steps:
            return loop
        loop.step()
    raise AssertionError("burst did not finish")


def ttft_steps(loop: Loop, rids) -> list[int]:
    return sorted(loop.first_token_step[r] - loop.arrival_step[r] for r in rids)


TF_ASYNC = "tokenflow.engine.scheduler.TokenFlowAsyncScheduler"
TF_SYNC = "tokenflow.engine.scheduler.TokenFlowScheduler"
FAST = {"dt": 0.05}


def table() -> list[dict]:
    burst = Burst()
    rows = []
    for name, cls, tf in (("stock AsyncScheduler", None, None),
                          ("TokenFlow (async)", TF_ASYNC, {**FAST, "policy": "tokenflow"}),
                          ("Andes (async)", TF_ASYNC, {**FAST, "policy": "andes"})):
        loop = run_burst(make_loop(cls, tf), burst)
        tail = [f"r{i}" for i in range(burst.requests, burst.requests + burst.late)]
        all_ttft = ttft_steps(loop, loop.tokens)
        stats = getattr(loop.scheduler, "tf_stats", None)
        rows.append({
            "scheduler": name, "steps": loop.step_no,
            "pauses_hold": stats.pauses_hold if stats else 0,
            "pauses_release": stats.pauses_release if stats else 0,
            "pauses_in_flight": stats.pauses_in_flight if stats else 0,
            "pauses_skipped": stats.pauses_skipped if stats else 0,
            "resumes": stats.resumes if stats else 0,
            "ttft_steps_p50": all_ttft[len(all_ttft) // 2], "ttft_steps_max": all_ttft[-1],
            "tail_ttft_steps_max": max(ttft_steps(loop, tail)),
        })
    return rows


def decision_time(requests: int = 400) -> dict:
    """Wall time (ms) of TokenFlow's decisions while at least 90% of a burst
    of `requests` is live, each with the snapshot of every request, the
    policy and the apply."""
    import statistics

    loop = make_loop(TF_ASYNC, {**FAST}, num_blocks=6000, max_num_seqs=256, max_num_batched_tokens=8192,
                     max_model_len=2048)
    run_burst(loop, Burst(requests=requests, late=0, late_after_steps=0, max_tokens=400))
    xs = sorted(1000 * s for n, s in loop.scheduler.reschedule_seconds if n >= 0.9 * requests)
    return {"requests": requests, "decisions": len(xs), "median_ms": statistics.median(xs),
            "p99_ms": xs[int(0.99 * (len(xs) - 1))]}


def burst_throughput(requests: int = 64, max_tokens: int = 400, num_blocks: int = 400) -> list[dict]:
    """Raw throughput of a burst on the fake clock (StepCost: 4 ms a step,
    0.2 ms a decode token, 0.02 ms a prefill token), stock, TokenFlow and
    Andes alike, with no host KV tier (a released request recomputes): the
    same figure every run, so a policy's cost in batch size can be told
    from this VM's noise. KV (`num_blocks` of 16 tokens) holds about half
    the burst at its full length. Over the run's middle half it reports
    the mean running batch and the KV blocks held by paused requests."""
    burst = Burst(requests=requests, late=0, late_after_steps=0, max_tokens=max_tokens, rates=(10.0, 20.0, 40.0))
    rows = []
    for name, cls, tf in (("stock", None, None), ("tokenflow", TF_SYNC, {"policy": "tokenflow", "dt": 0.1}),
                          ("andes", TF_SYNC, {"policy": "andes", "dt": 0.1})):
        loop = make_loop(cls, tf, async_scheduling=False, num_blocks=num_blocks, max_num_seqs=32,
                         max_num_batched_tokens=2048, max_model_len=2048)
        seen = []

        def on_step(lp):
            s = lp.scheduler
            held = sum(s._blocks(r.num_tokens) for r in getattr(s, "held", {}).values())
            seen.append((lp.clock.t, len(s.running), held))

        run_burst(loop, burst, on_step)
        t, tokens = loop.clock.t, sum(len(v) for v in loop.tokens.values())
        mid = [x for x in seen if 0.25 * t <= x[0] < 0.75 * t]
        stats = getattr(loop.scheduler, "tf_stats", None)
        rows.append({"scheduler": name, "tokens": tokens, "fake_s": round(t, 3), "tokens_per_s": round(tokens / t, 1),
                     "steps": loop.step_no, "mid_running": round(sum(x[1] for x in mid) / len(mid), 1),
                     "mid_held_blocks": round(sum(x[2] for x in mid) / len(mid), 1),
                     "pauses_hold": stats.pauses_hold if stats else 0,
                     "pauses_release": stats.pauses_release if stats else 0,
                     "tokens_recomputed": stats.tokens_recomputed if stats else 0})
    return rows


MIX = ((1, 0.5), (2, 0.3), (4, 0.2))  # effective_burst's readers: (rate in units of r, share of the readers)


def effective_burst(load: float = 0.5, requests: int = 128, max_tokens: int = 512, slots: int = 64,
                    host_tier: bool = True, tokenflow: dict | None = None, mix: tuple = MIX) -> list[dict]:
    """Effective throughput of a burst on the fake clock, stock beside
    TokenFlow and Andes: `requests` readers at once, two per slot, reading
    at r, 2r and 4r tokens/s (half, 3 and 2 in ten of them; `mix`) with r set so
    that together they need `load` of what a full batch decodes (64 slots
    at 4 ms + 0.2 ms a token: about 3,800 tokens/s, 60 a stream). Each
    token's time is the fake clock's at the step that made it, and its
    weight is the effective-throughput weight of its reader's buffer then
    (tokenflow.core.buffer); each reader's stall after its first token and
    its Andes QoE come from the same times. With `host_tier` every
    scheduler's engine has a host KV tier (tests/fake_host_tier.py): a
    request released or preempted gets its full blocks back at no cost to
    the batch and recomputes only its tail, as with the offloading
    connector on a GPU; the policy is told of the tier as reloading at the
    fake prefill speed (what it prices a slot's wait for a reload at).
    `tokenflow`: settings over the defaults for TokenFlow and Andes. The
    same figures every run, so policies can be told apart from this VM's
    noise."""
    from tokenflow.core.buffer import ReaderBuffer
    from tokenflow.engine import scheduler as sched_mod

    full_rate = slots / (StepCost.base_s + StepCost.decode_s * slots)
    base = load * full_rate / (requests * sum(m * w for m, w in mix))
    snapshot = sched_mod.TokenFlowMixin.snapshot

    def with_tier(self, now):
        views, eng = snapshot(self, now)
        eng.transfer_tps, eng.host_blocks = 1.0 / StepCost.prefill_s, 100 * slots * max_tokens
        return views, eng

    rows = []
    try:
        if host_tier:
            sched_mod.TokenFlowMixin.snapshot = with_tier
        settings = tokenflow or {}
        for name, cls, tf in (("stock", None, None), ("tokenflow", TF_SYNC, {**settings, "policy": "tokenflow"}),
                              ("andes", TF_SYNC, {**settings, "policy": "andes"})):
            loop = make_loop(cls, tf, async_scheduling=False, num_blocks=slots * (max_tokens + 64) // BLOCK * 2,
                             max_num_seqs=slots, max_num_batched_tokens=4096, max_model_len=2048,
                             host_tier=host_tier)
            rng = random.Random(0)
            rates = {}
            for i in range(requests):
                x = rng.random()
                rates[f"r{i}"] = base * _share_of(mix, x)
                loop.add(f"r{i}", [rng.randrange(10, VOCAB) for _ in range(40)], max_tokens, rates[f"r{i}"])
            times: dict[str, list[float]] = {k: [] for k in rates}
            while loop.busy():
                seen = {k: len(v) for k, v in loop.tokens.items()}
                loop.step()
                for k, v in loop.tokens.items():
                    times[k].extend([loop.clock.t] * (len(v) - seen[k]))
            wall, tokens, weight, lost, stall, qoe = loop.clock.t, 0, 0.0, {}, 0.0, 0.0
            for k, ts in times.items():
                reader = ReaderBuffer.replay(rates[k], 0.0, ts)
                w = sum(reader.weights())
                tokens, weight = tokens + len(ts), weight + w
                # Stalls after the first token, until the last one came.
                stall, qoe = stall + reader.stall_time(ts[-1]), qoe + reader.qoe()
                lost[f"{rates[k]:.3g}"] = round(lost.get(f"{rates[k]:.3g}", 0.0) + len(ts) - w)
            first = sorted(ts[0] for ts in times.values())
            stats = getattr(loop.scheduler, "tf_stats", None)
            rows.append({"scheduler": name, "load": load, "fake_s": round(wall, 2),
                         "tokens_per_s": round(tokens / wall), "effective_per_s": round(weight / wall),
                         "lost_share": round(1 - weight / tokens, 3), "lost_by_rate": lost,
                         "ttft_p99_s": round(first[int(0.99 * (len(first) - 1))], 3),
                         "ttft_mean_s": round(sum(first) / len(first), 3),
                         "stall_mean_s": round(stall / len(times), 3), "qoe_mean": round(qoe / len(times), 3),
                         "pauses": stats.pauses_hold + stats.pauses_release if stats else 0})
    finally:
        sched_mod.TokenFlowMixin.snapshot = snapshot
    return rows


def _share_of(mix, x: float):
    """The mix's value whose share of [0, 1) holds x (shares in order)."""
    for value, share in mix:
        if x < share:
            return value
        x -= share
    return mix[-1][0]


def step_overhead(requests: int = 32, max_tokens: int = 300, reps: int = 5) -> dict:
    """Scheduler wall time per step, in microseconds, with nothing
    contending: `requests` decoding in 64 slots with KV to spare, so
    TokenFlow decides nothing and only its bookkeeping runs. `schedule()`
    and `update_from_output()` are timed from outside and, in TokenFlow's
    runs, also vLLM's own part within them (the methods its mixin calls
    through `super()`), so what TokenFlow adds is read off the same steps
    (VM noise moves the whole step by 20-30% between runs). Medians over
    `reps` runs after a warm-up."""
    import gc
    import statistics
    import time

    from vllm.v1.core.sched.scheduler import Scheduler

    def timed(f, spent):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    def one(cls, tf) -> tuple[float, float]:
        loop = make_loop(cls, tf, async_scheduling=False, num_blocks=4000, max_num_seqs=64,
                         max_num_batched_tokens=2048, max_model_len=1024)
        sched, outer, inner = loop.scheduler, [0.0], [0.0]
        originals = {name: getattr(Scheduler, name) for name in ("schedule", "update_from_output")}
        for name, f in originals.items():
            setattr(sched, name, timed(getattr(sched, name), outer))
            setattr(Scheduler, name, timed(f, inner))
        try:
            rng = random.Random(0)
            for i in range(requests):
                loop.add(f"r{i}", [rng.randrange(10, VOCAB) for _ in range(64)], max_tokens, 20.0)
            gc.collect()
            loop.run()
        finally:
            for name, f in originals.items():
                setattr(Scheduler, name, f)
        stats = getattr(sched, "tf_stats", None)
        assert stats is None or stats.decisions == 0, "a decision was taken: the run contended"
        return 1e6 * outer[0] / loop.step_no, 1e6 * inner[0] / loop.step_no

    stock, tf_total, tf_vllm = [], [], []
    for rep in range(reps + 1):
        s_us, _ = one(None, None)
        t_us, v_us = one(TF_SYNC, {"policy": "tokenflow"})
        if rep:  # the first pair warms up
            stock.append(s_us)
            tf_total.append(t_us)
            tf_vllm.append(v_us)
    med = statistics.median
    return {"requests": requests, "stock_us_per_step": round(med(stock), 1),
            "tokenflow_us_per_step": round(med(tf_total), 1),
            "tokenflow_own_us_per_step": round(med(t - v for t, v in zip(tf_total, tf_vllm)), 1)}


if __name__ == "__main__":
    import json
    import sys

    if "--decision-time" in sys.argv:
        print(json.dumps(decision_time()))
    elif "--step-overhead" in sys.argv:
        print(json.dumps(step_overhead()))
    elif "--effective" in sys.argv:
        # --effective [LOAD] [--no-tier] [--tokenflow JSON]
        i = sys.argv.index("--effective")
        load = float(sys.argv[i + 1]) if len(sys.argv) > i + 1 and not sys.argv[i + 1].startswith("-") else 0.5
        tf = json.loads(sys.argv[sys.argv.index("--tokenflow") + 1]) if "--tokenflow" in sys.argv else None
        for row in effective_burst(load, host_tier="--no-tier" not in sys.argv, tokenflow=tf):
            print(json.dumps(row))
    elif "--burst-throughput" in sys.argv:
        for row in burst_throughput():
            print(json.dumps(row))
    else:
        for row in table():
            print(json.dumps(row))
