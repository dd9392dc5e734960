"""Decision time of a policy over synthetic populations (`tokenflow bench-policy`).

Two populations (`--population`):
- burst: a burst in progress: a third waiting, a half running with buffers
  of 0-30 s, the rest paused; KV is tight so every call has to pack;
- stalling: every slot held by a guarded reader (past its pause level, not
  yet past its swap's share), and readers at their resume level outside
  with spare capacity, so each decision buys guarded places within the
  swap budget (`TokenFlowPolicy.room_beside_guard`).
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tokenflow.core.andes import AndesPolicy
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policy import EngineView, Phase, RequestColumns, RequestView, TokenFlowPolicy


def population(n: int, seed: int = 0) -> tuple[list[RequestView], EngineView]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        u = rng.random()
        phase = Phase.WAITING if u < 0.33 else Phase.RUNNING if u < 0.83 else Phase.PAUSED
        rate = rng.choice([5.0, 10.0, 20.0, 40.0])
        out = 0 if phase == Phase.WAITING else rng.randint(1, 1000)
        prompt = rng.randint(64, 1024)
        reqs.append(RequestView(
            req_id=f"req-{i}", phase=phase, arrival_time=rng.random() * 10, rate=rate,
            buffer_tokens=0.0 if not out else rng.random() * 30 * rate, num_output=out,
            max_tokens=out + rng.randint(1, 1024), num_tokens=prompt + out, blocks=(prompt + out) // 16 + 1,
            kv_resident=phase != Phase.WAITING and rng.random() < 0.7,
        ))
    total = sum(r.blocks for r in reqs) // 2
    eng = EngineView(block_size=16, total_blocks=total, free_blocks=total // 10,
                     max_num_seqs=256, decode_tps=n * 60.0, step_rate=40.0, prefill_tps=20_000.0,
                     transfer_tps=200_000.0, host_blocks=total)
    return reqs, eng


def stalling(n: int, seed: int = 0) -> tuple[list[RequestView], EngineView]:
    """Seven in ten of `n` run, each a guarded reader; the rest are paused
    with empty buffers, their KV released to the host."""
    rng = random.Random(seed)
    slots = max(1, 7 * n // 10)
    reqs = [RequestView(f"run-{i}", Phase.RUNNING, 0.0, 10.0, 30.0 + rng.random(), 40, 1000, 100, 7, True)
            for i in range(slots)]
    reqs += [RequestView(f"dry-{i}", Phase.PAUSED, 0.0, 10.0, 0.0, 40, 1000, 100, 7, False, host_blocks=6)
             for i in range(n - slots)]
    # A fixed cost of 10 ms a step: what the readers need (10 tokens/s each)
    # is a tenth of what the slots decode; the budget buys 16 places a
    # decision at every size.
    eng = EngineView(block_size=16, total_blocks=100 * n, free_blocks=96 * n, max_num_seqs=slots,
                     decode_tps=100.0 * slots, step_rate=100.0, prefill_tps=1000.0, start_s=0.01,
                     step_cost=(0.01, 0.0), transfer_tps=1e5, host_blocks=100 * n, running=slots)
    return reqs, eng


POPULATIONS = {"burst": population, "stalling": stalling}


def measure(policy_name: str, n: int, repeats: int = 200, build=population) -> dict:
    cfg = TokenFlowConfig(policy=policy_name)
    policy = TokenFlowPolicy(cfg) if policy_name == "tokenflow" else AndesPolicy(cfg)
    reqs, eng = build(n)
    if policy_name == "tokenflow":
        reqs = RequestColumns.of(reqs)  # as the scheduler's snapshot gives them
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        policy.decide(reqs, eng)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    # CPU time of this thread is what the decision costs; wall time adds
    # whatever else the machine runs meanwhile (noisy on 2 shared cores).
    return {"policy": policy_name, "requests": n, **_stats("wall", wall), **_stats("cpu", cpu)}


def _stats(tag: str, xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        f"{tag}_median_ms": round(statistics.median(xs) * 1e3, 4),
        f"{tag}_p99_ms": round(xs[int(0.99 * (len(xs) - 1))] * 1e3, 4),
    }


def main(sizes=(100, 400, 1000), policies=("tokenflow", "andes"), repeats: int = 200,
         population_name: str = "burst") -> list[dict]:
    build = POPULATIONS[population_name]
    rows = [{**measure(p, n, repeats, build), "population": population_name} for p in policies for n in sizes]
    for row in rows:
        print(json.dumps(row))
    return rows


def compare(other_path: str, n: int = 400, rounds: int = 30, per_round: int = 50,
            population_name: str = "burst") -> dict:
    """A/B the policy against another version of tokenflow/core/policy.py
    (for example `git show REV:tokenflow/core/policy.py > /tmp/p.py`):
    decide() at `n` requests, rounds alternating which runs first, so that
    the machine's drift hits both alike; the decisions must be equal."""
    path = Path(other_path)
    if not path.is_file():
        raise SystemExit(f"bench-policy: no such policy module: {other_path}")
    spec = importlib.util.spec_from_file_location("tokenflow_policy_other", path)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other  # dataclasses look their module up there
    spec.loader.exec_module(other)
    reqs, eng = POPULATIONS[population_name](n)
    views = {"this": (TokenFlowPolicy(TokenFlowConfig()), RequestColumns.of(reqs), eng),
             "other": (other.TokenFlowPolicy(TokenFlowConfig()), *_rebuilt(other, reqs, eng))}
    medians: dict[str, list[float]] = {"this": [], "other": []}
    for i in range(rounds):
        for name in ("this", "other") if i % 2 else ("other", "this"):
            policy, rs, e = views[name]
            times = []
            for _ in range(per_round):
                t = time.perf_counter()
                policy.decide(rs, e)
                times.append(time.perf_counter() - t)
            medians[name].append(statistics.median(times))
    decisions = [p.decide(rs, e) for p, rs, e in views.values()]
    same = [d and (d.order, d.admit, d.run, d.pause_hold, d.pause_release, d.defer, d.wait, d.recompute)
            for d in decisions]
    this, other_ms = (statistics.median(medians[k]) * 1e3 for k in ("this", "other"))
    row = {"requests": n, "population": population_name, "this_median_ms": round(this, 4), "other_median_ms": round(other_ms, 4),
           "ratio": round(this / other_ms, 3), "same_decision": same[0] == same[1]}
    print(json.dumps(row))
    return row


def _rebuilt(mod, reqs: list[RequestView], eng: EngineView):
    """The population in the other module's own classes (its Phase enum is
    a different type, so `is` comparisons need its members)."""
    fields = set(mod.RequestView.__dataclass_fields__)
    rs = [mod.RequestView(**{k: getattr(r, k) for k in fields if k != "phase"}, phase=mod.Phase(r.phase.value))
          for r in reqs]
    e = mod.EngineView(**{k: getattr(eng, k) for k in mod.EngineView.__dataclass_fields__ if hasattr(eng, k)})
    if hasattr(mod, "RequestColumns"):  # a policy that decides over columns: built once, as for this one
        rs = mod.RequestColumns.of(rs)
    return rs, e
