"""Decision time of a policy over synthetic populations (`tokenflow bench-policy`).

The population is a burst in progress: a third waiting, a half running with
buffers of 0-30 s, the rest paused; KV is tight so every call has to pack.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from tokenflow.core.andes import AndesPolicy
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policy import EngineView, Phase, RequestView, TokenFlowPolicy


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


def measure(policy_name: str, n: int, repeats: int = 200) -> dict:
    cfg = TokenFlowConfig(policy=policy_name)
    policy = TokenFlowPolicy(cfg) if policy_name == "tokenflow" else AndesPolicy(cfg)
    reqs, eng = population(n)
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


def main(sizes=(100, 400, 1000), policies=("tokenflow", "andes"), repeats: int = 200) -> list[dict]:
    rows = [measure(p, n, repeats) for p in policies for n in sizes]
    for row in rows:
        print(json.dumps(row))
    return rows
