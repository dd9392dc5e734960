"""The host KV tier (tokenflow/kv_offload/) under vLLM's OffloadingConnector.

Fast tests drive the manager and the CPU copy worker directly; slow ones run
a real in-process engine (tiny model with real random weights, KV pool of
32 blocks of 32 tokens) with the TokenFlow scheduler, and check that paused
requests come back from the host pool with vLLM's exact greedy tokens.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import pytest
import torch

from tokenflow.kv_offload import kv_transfer_config
from tokenflow.kv_offload.manager import HostBlocks, HostPoolManager
from tokenflow.kv_offload.worker import HostPoolWorker

TF = "tokenflow.engine.scheduler.TokenFlowScheduler"
FAST = {"dt": 0.02}
BLOCK = 32  # tests/engines.py SMALL_POOL block_size


# --- manager, no engine -----------------------------------------------------
def ctx(req_id: str):
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id=req_id)


def key(i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), 0)


def stored(m: HostPoolManager, req: str, ids) -> list[bytes]:
    keys = [key(i) for i in ids]
    out = m.prepare_store(keys, ctx(req))
    assert out is not None
    m.complete_store(out.keys_to_store, ctx(req))
    return keys


def test_manager_evicts_oldest_idle_first_and_never_busy_blocks():
    from vllm.v1.kv_offload.base import LookupResult

    m = HostPoolManager(num_blocks=4, bytes_per_block=100, bytes_per_token=1.0)
    a = stored(m, "a", [0, 1])
    b = stored(m, "b", [2, 3])
    m.on_request_finished(ctx("a"))  # a's blocks: first eviction tier
    c = stored(m, "c", [4])
    # a went tail first, so what is left of it is still a loadable prefix.
    assert m.lookup(a[1], ctx("x")) is LookupResult.MISS
    assert all(m.lookup(k, ctx("x")) is LookupResult.HIT for k in [a[0]] + b + c)
    assert m.counters.evictions == 1 and m.counters.evicted_live == 0
    # Pin c and b with loads (b last, so b is the most recent), and key 5
    # with an unfinished store: then every block is busy.
    m.prepare_load(c, ctx("c"))
    m.prepare_load(b, ctx("b"))
    pending = m.prepare_store([key(5)], ctx("d"))  # takes a's last block
    assert pending is not None and pending.evicted_keys == [a[0]]
    assert m.prepare_store([key(6)], ctx("d")) is None
    assert m.counters.stores_rejected == 1
    assert m.lookup(key(5), ctx("x")) is LookupResult.HIT_PENDING
    m.complete_load(b, ctx("b"))
    m.complete_load(c, ctx("c"))
    m.complete_store(pending.keys_to_store, ctx("d"))
    assert m.pinned_blocks() == 0
    assert m.counters.blocks_loaded == 3 and m.counters.bytes_loaded == 300
    # Now live blocks go, least recently used first.
    out = m.prepare_store([key(6)], ctx("d"))
    assert out.evicted_keys == c and m.counters.evicted_live == 1


def test_manager_trims_a_paused_request_from_its_tail():
    from vllm.v1.kv_offload.base import ScheduleEndContext

    m = HostPoolManager(num_blocks=4, bytes_per_block=1, bytes_per_token=1.0)
    a = stored(m, "a", [0, 1, 2])
    stored(m, "b", [3])
    m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=("a",)))
    assert m.host_blocks_of("a") == 3
    out = m.prepare_store([key(4)], ctx("b"))
    assert out.evicted_keys == [key(3)]  # b's old block: a was touched at its pause
    out = m.prepare_store([key(5)], ctx("b"))
    assert out.evicted_keys == [a[2]]  # a loses its tail, keeps a loadable prefix
    assert m.host_blocks_of("a") == 2


def test_manager_stores_the_prefix_that_fits():
    m = HostPoolManager(num_blocks=3, bytes_per_block=1, bytes_per_token=1.0)
    stored(m, "a", [0])
    m.prepare_load([key(0)], ctx("a"))  # busy: cannot be evicted
    out = m.prepare_store([key(i) for i in range(10, 15)], ctx("b"))
    assert out.keys_to_store == [key(10), key(11)] and m.counters.blocks_dropped == 3
    m.complete_store(out.keys_to_store, ctx("b"))
    assert m.host_blocks_of("b") == 2


def test_manager_failed_store_frees_rows_and_reset_empties():
    m = HostPoolManager(num_blocks=2, bytes_per_block=1, bytes_per_token=1.0)
    out = m.prepare_store([key(0), key(1)], ctx("a"))
    m.complete_store(out.keys_to_store, ctx("a"), success=False)
    assert m.stored_blocks() == 0 and m.counters.blocks_stored == 0
    stored(m, "a", [0, 1])
    m.reset_cache()
    assert m.stored_blocks() == 0 and m.host_blocks_of("a") == 0
    stored(m, "a", [2, 3])  # the whole pool is usable again


# --- CPU copy worker, no engine ---------------------------------------------
def kv_caches(num_blocks: int, row_bytes: int):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = [torch.randint(-128, 127, (num_blocks, row_bytes), dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, row_bytes) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, row_bytes), CanonicalKVCacheRef(1, row_bytes)]],
    ), tensors


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_worker_round_trip(blocks_per_chunk):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    caches, dev = kv_caches(num_blocks=8, row_bytes=64)
    before = [t.clone() for t in dev]
    w = HostPoolWorker(caches, num_rows=4, blocks_per_chunk=blocks_per_chunk)
    src = [5, 2, 7]  # three engine blocks, logically blocks 0..2 of a request
    rows = [3, 1] if blocks_per_chunk == 2 else [3, 1, 0]
    assert w.submit_store(1, GPULoadStoreSpec(src, [3], [0]), HostBlocks(rows))
    for t in dev:
        t.zero_()
    # Load back the last two blocks (logical 1..2) into other engine blocks.
    dst = [0, 4]
    skip_rows = rows if blocks_per_chunk == 2 else rows[1:]
    assert w.submit_load(2, HostBlocks(skip_rows), GPULoadStoreSpec(dst, [2], [1]))
    done = w.get_finished()
    assert [r.job_id for r in done] == [1, 2] and all(r.success for r in done)
    assert done[0].transfer_size == 3 * 64 * 2 and done[1].transfer_size == 2 * 64 * 2
    for t, ref in zip(dev, before):
        assert torch.equal(t[0], ref[2]) and torch.equal(t[4], ref[7])
        assert not t[[1, 2, 3, 5, 6, 7]].any()


# --- real engine -------------------------------------------------------------
class NoCopyOnLoadWorker(HostPoolWorker):
    """Negative control: a load that reports success but copies nothing, so
    the resumed request reads whatever its new blocks held before."""

    def load_blocks(self, copy):
        return


def greedy(n=96, rate=20.0):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, extra_args={"consumption_rate": rate})


@dataclass
class Resumes:
    """Per re-admission of a preempted request: tokens whose KV it had
    computed before the pause and computes again."""

    at_pause: dict[str, int] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)  # req_id -> num_preemptions handled
    recomputed: list[int] = field(default_factory=list)


def watch_resumes(sched) -> Resumes:
    """Wrap this scheduler instance's preemption and schedule() to count
    recomputed tokens (the class stays tokenflow.engine.scheduler.TokenFlowScheduler)."""
    rec = Resumes()
    preempt, schedule = sched._preempt_request, sched.schedule

    def _preempt_request(request, *a, **kw):
        rec.at_pause[request.request_id] = request.num_computed_tokens
        return preempt(request, *a, **kw)

    def _schedule(*a, **kw):
        out = schedule(*a, **kw)
        for req_id, n in out.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            if req.num_preemptions > rec.seen.get(req_id, 0):
                rec.seen[req_id] = req.num_preemptions
                before = req.num_computed_tokens - n  # loaded or locally cached
                rec.recomputed.append(max(0, rec.at_pause[req_id] - before))
        return out

    sched._preempt_request, sched.schedule = _preempt_request, _schedule
    return rec


@dataclass
class Run:
    tokens: list[list[int]]
    stats: object = None
    counters: object = None
    resumes: Resumes | None = None
    scheduler_tps: float | None = None
    pinned_after: int = 0
    deferred_chunks: int | None = None  # store-budget deferrals (TokenFlow connector)
    reloads_skipped: int | None = None  # resumes the policy chose to recompute
    offload: object = None  # the typed host-tier counters the replica reads (TokenFlow scheduler)


def run_burst(offload: dict | None = None, tokenflow: bool = True, spec: type | None = None,
              patch=None) -> Run:
    from tests.engines import burst_prompts, drain, make_llm, scheduler_of
    from tokenflow.kv_offload import spec as spec_mod
    from tokenflow.kv_offload.tier import host_pool_of

    kw = {}
    if offload is not None:
        kw["kv_transfer_config"] = offload
    if spec is not None:
        setattr(spec_mod, spec.__name__, spec)  # importable by name for vLLM's spec factory
        offload["kv_connector_extra_config"]["spec_name"] = spec.__name__
    try:
        llm = make_llm(TF if tokenflow else None, FAST if tokenflow else None, **kw)
        sched = scheduler_of(llm)
        if patch is not None:
            patch(sched)
        rec = watch_resumes(sched)
        prompts = burst_prompts()
        outs = llm.generate(prompts, [greedy() for _ in prompts], use_tqdm=False)
        drain(llm)
        pool = host_pool_of(sched.connector)
        run = Run(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            stats=getattr(sched, "tf_stats", None),
            counters=pool.counters if pool else None,
            resumes=rec,
            scheduler_tps=sched.host_tier.transfer_tps() if tokenflow and sched.host_tier else None,
            pinned_after=pool.pinned_blocks() if pool else 0,
            deferred_chunks=getattr(getattr(sched.connector, "store_budget", None), "deferred_chunks", None),
            reloads_skipped=getattr(sched.connector, "reloads_skipped", None),
            offload=sched.scheduler_state().offload if tokenflow else None,
        )
        del llm, sched
        gc.collect()
        return run
    finally:
        if spec is not None:
            delattr(spec_mod, spec.__name__)


@pytest.fixture(scope="module")
def baseline():
    run = run_burst(tokenflow=False)
    assert all(len(t) == 96 for t in run.tokens)
    return run.tokens


@pytest.mark.slow
@pytest.mark.parametrize("tokenflow_connector", [False, True], ids=["stock-connector", "tokenflow-connector"])
def test_released_requests_reload_from_host(baseline, tokenflow_connector):
    # The stock connector gives the policy no transfer speed or host pool
    # size; TokenFlow's gives both (the policy's working set then spans the
    # host pool). Either way a pause releases KV and the resume reloads it.
    run = run_burst(kv_transfer_config(host_pool_bytes=64 << 20, tokenflow_connector=tokenflow_connector))
    c = run.counters
    assert run.stats.pauses_release > 0, "the burst must force KV-releasing pauses"
    assert c.blocks_stored > 0 and c.blocks_loaded > 0 and c.lookup_hits > 0
    assert c.evictions == 0, "the pool holds the whole burst"
    assert run.resumes.recomputed, "released requests came back"
    # Everything already computed came back from the host pool, except at
    # most the last, partly filled block.
    assert max(run.resumes.recomputed) < BLOCK
    # The scheduler's own count agrees: under one block per resume.
    assert run.stats.resumed_after_release > 0
    assert run.stats.tokens_recomputed < BLOCK * run.stats.resumed_after_release
    assert run.tokens == baseline
    assert run.pinned_after == 0


@pytest.mark.slow
def test_the_host_pool_can_be_a_slot_of_the_nodes_shared_memory(baseline):
    """What a Serve replica gets from its node's KV pool actor: a slot of the
    node's one shared-memory file. Write-through lands in that slot and
    nowhere else in the file, and resumes reload from it."""
    import mmap
    import os

    import numpy as np

    from tokenflow.kv_offload.host_shm import PoolFile

    slot = 64 << 20
    f = PoolFile("/dev/shm", f"engine-test-{os.getpid()}", 2 * slot)
    try:
        run = run_burst(kv_transfer_config(region=f.region(1, slot)))
        node = np.frombuffer(mmap.mmap(f.fd, f.nbytes), dtype=np.uint8)
        assert not node[:slot].any(), "the engine wrote outside its slot"
        assert node[slot:].any(), "the engine's KV is not in the node's pool"
        assert run.counters.blocks_loaded > 0 and run.stats.pauses_release > 0
        assert max(run.resumes.recomputed) < BLOCK
        assert run.tokens == baseline
        assert run.pinned_after == 0
    finally:
        f.close()


@pytest.mark.slow
def test_a_tight_store_budget_defers_stores_and_outputs_stay_equal(baseline):
    # 0.05% of the measured store speed (the tiny model copies ~1.7M tokens/s,
    # far more than a burst writes): most write-through waits for later
    # steps (some requests pause before theirs is stored and recompute).
    run = run_burst(kv_transfer_config(host_pool_bytes=64 << 20, store_share=0.0005))
    assert run.deferred_chunks > 0, "the budget never held a store back"
    assert run.counters.blocks_stored > 0 and run.stats.pauses_release > 0
    assert run.tokens == baseline
    assert run.pinned_after == 0


def test_store_budget_spends_on_the_largest_buffers_first():
    from tokenflow.kv_offload.store_budget import PendingStore, StoreBudget

    b = StoreBudget(share=0.5, max_credit_s=1.0)
    assert not b.refill(None, 0.0)  # nothing measured yet: no cap
    assert b.refill(1000.0, 0.2)  # 0.2 s at 500 tok/s of stores: 100 tokens
    assert b.credit_tokens == pytest.approx(100.0)
    pending = [PendingStore("small", 1.0, next_chunk=3, pending=2), PendingStore("big", 9.0, 0, 2),
               PendingStore("done", float("-inf"), 5, 1)]
    # 32 tokens a chunk: 3 chunks of credit. "big" gets both, "small" one,
    # the finished request none; caps are chunk indices to stop at.
    assert b.allot(pending, 32) == {"small": 4, "done": 5}
    assert b.deferred_chunks == 2 and b.credit_tokens == pytest.approx(4.0)
    # Idle time saves up at most max_credit_s of store work.
    b.refill(1000.0, 100.0)
    assert b.credit_tokens == pytest.approx(500.0)
    with pytest.raises(ValueError, match="store_share"):
        StoreBudget(share=1.5)


@pytest.mark.slow
def test_resumes_the_policy_prices_as_recompute_are_recomputed(baseline):
    # Price every reload above its prefill (as a slow bus would): released
    # requests come back by recompute although the host pool holds their KV.
    def recompute_always(sched):
        # Every released request the host holds any of, whenever a transfer
        # speed is known (the policy weighs nothing before).
        sched.policy.recomputes = lambda cols, rows, eng: (cols.host_blocks[rows] != 0) & bool(eng.transfer_tps)

    run = run_burst(kv_transfer_config(host_pool_bytes=64 << 20), patch=recompute_always)
    assert run.stats.pauses_release > 0 and run.counters.blocks_stored > 0
    assert run.reloads_skipped > 0, "no resume was steered to recompute"
    assert run.offload.reloads_skipped == run.reloads_skipped  # in the typed counters the replica reads
    assert max(run.resumes.recomputed) >= BLOCK, "every resume still reloaded"
    assert run.tokens == baseline


@pytest.mark.slow
def test_load_that_skips_the_copy_is_caught(baseline):
    from tokenflow.kv_offload.spec import TokenFlowOffloadingSpec

    broken = type("NoCopyOnLoadSpec", (TokenFlowOffloadingSpec,), {"cpu_worker_cls": NoCopyOnLoadWorker})
    run = run_burst(kv_transfer_config(host_pool_bytes=64 << 20, tokenflow_connector=False), spec=broken)
    assert run.counters.blocks_loaded > 0
    assert max(run.resumes.recomputed) < BLOCK  # vLLM trusted the "loaded" KV
    assert run.tokens != baseline


@pytest.mark.slow
def test_pool_far_smaller_than_burst_recomputes(baseline):
    # 12 host blocks against a burst that writes through 72: blocks are
    # evicted while their requests are paused, and those requests load what
    # is left of their prefix and recompute the rest.
    run = run_burst(kv_transfer_config(host_pool_blocks=12, tokenflow_connector=False))
    c = run.counters
    assert c.capacity_blocks == 12
    assert c.evictions > 0 and c.evicted_live > 0 and c.lookup_misses > 0
    assert max(run.resumes.recomputed) >= BLOCK, "some request lost its host copy and recomputed"
    assert run.tokens == baseline
    assert run.pinned_after == 0


@pytest.mark.slow
def test_abort_releases_the_requests_host_blocks():
    from tests.engines import make_llm, scheduler_of
    from tokenflow.kv_offload.tier import host_pool_of

    llm = make_llm(TF, {"dt": 0.05}, max_num_seqs=4, kv_transfer_config=kv_transfer_config(host_pool_blocks=64))
    engine, sched = llm.llm_engine, scheduler_of(llm)
    pool = host_pool_of(sched.connector)
    try:
        for i in range(4):
            engine.add_request(f"r{i}", f"reader {i} stream river mountain", greedy(n=300))
        for _ in range(200):
            engine.step()
            if pool.counters.blocks_stored >= 12:
                break
        ids = {rid[:2]: rid for rid in sched.requests}
        victim = ids["r0"]
        mine = pool.keys_of(victim)
        assert len(mine) >= 2 and pool.live_blocks() >= len(mine)
        others = {k for rid in ids.values() if rid != victim for k in pool.keys_of(rid)}
        engine.abort_request(["r0"])
        for _ in range(3):
            engine.step()
        assert victim not in sched.requests
        assert pool.keys_of(victim) == [] and pool.host_blocks_of(victim) == 0
        # Its blocks stay loadable for a shared prefix, but are no longer live:
        # they are the first the pool evicts.
        assert all(pool.tier_of(k) == "idle" for k in mine if k not in others)
        assert pool.pinned_blocks(mine) == 0  # the others may be storing now
        # The TokenFlow connector hands the measured copy speed to the scheduler.
        assert pool.counters.store.total_bytes > 0
        assert sched.host_tier.transfer_tps() == pool.counters.transfer_tps > 0
        engine.abort_request(["r1", "r2", "r3"])
        for _ in range(3):
            engine.step()
        assert pool.live_blocks() == 0 and not sched.requests
    finally:
        del llm
        gc.collect()
