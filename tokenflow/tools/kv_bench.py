"""Pause-and-resume cost on this machine: reload from the host pool vs recompute.

    python -m tokenflow.tools.kv_bench [--contexts 512 2048 8192] [--repeats 5] [--shared-memory]

One in-process engine on the tiny model (a copy of its directory with 16k
positions, so 8192-token contexts fit), GPU-side prefix caching off so a
repeated prompt can only come back from the host pool. Per context length
and repeat, with a fresh random prompt:
  1. cold: the prompt with max_tokens=1 = a full prefill (what a paused
     request without offload recomputes); write-through stores its blocks;
  2. warm: the same prompt again = lookup + load of every block + one token.
One JSON line per context (minimum over repeats: the machine is shared):
  floor_s        an 8-token request, end to end: the engine's per-request floor
  prefill_s      cold request, end to end
  reload_s       warm request, end to end
  load_copy_s    the host->engine copy alone, as the transfer handler timed it
  store_copy_s   the engine->host copy of write-through, likewise
  bytes_moved    bytes loaded for the warm request
  load_GBps, speedup (prefill_s / reload_s)
The engine runs on CPU here, so the "device" KV is host memory as well: this
measures the copy path and the protocol overhead, not a PCIe link.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32


def long_context_model(src: Path, positions: int) -> Path:
    """A copy of the tiny model that accepts longer contexts. RoPE weights do
    not depend on max_position_embeddings, so only config.json changes."""
    from tokenflow.tools.tiny_model import make_tiny_model

    make_tiny_model(src)
    out = Path(tempfile.mkdtemp(prefix="tiny-llama-long-"))
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_engine(model: Path, max_len: int, pool_bytes: int, region=None):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read the pool in-process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    from tokenflow.kv_offload import kv_transfer_config

    kv_bytes = 2 * max_len * 2048  # two contexts of the tiny model (2 KiB a token)
    return LLM(model=str(model), enforce_eager=True, seed=0, dtype="float32", block_size=BLOCK,
               max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=4,
               kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False,
               kv_transfer_config=kv_transfer_config(host_pool_bytes=pool_bytes, region=region))


def timed_generate(llm, token_ids: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=token_ids)], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - t0


def measure(llm, pool, context: int, repeats: int, rng) -> dict:
    c = pool.counters
    rows = []
    for _ in range(repeats):
        prompt = rng.integers(4, 1500, context).tolist()
        s0 = (c.store.total_bytes, c.store.total_seconds)
        prefill = timed_generate(llm, prompt)
        timed_generate(llm, [5, 6, 7])  # one more step: the finished request's stores run
        l0 = (c.load.total_bytes, c.load.total_seconds, c.blocks_loaded)
        reload = timed_generate(llm, prompt)
        floor = timed_generate(llm, rng.integers(4, 1500, 8).tolist())
        rows.append(dict(
            floor_s=floor,
            prefill_s=prefill,
            reload_s=reload,
            load_copy_s=c.load.total_seconds - l0[1],
            store_copy_s=c.store.total_seconds - s0[1],
            bytes_moved=c.load.total_bytes - l0[0],
            blocks_loaded=c.blocks_loaded - l0[2],
        ))
    # The least disturbed repeat: the machine is shared, and noise only adds.
    best = {k: min(r[k] for r in rows) for k in rows[0]}
    best["load_GBps"] = best["bytes_moved"] / best["load_copy_s"] / 1e9 if best["load_copy_s"] else None
    best["speedup"] = best["prefill_s"] / best["reload_s"]
    return {"context_tokens": context, "repeats": repeats, **best}


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    from tokenflow.kv_offload.tier import host_pool_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--shared-memory", action="store_true",
                    help="the pool as a slot of a node pool file in /dev/shm, as under Serve")
    args = ap.parse_args(argv)

    max_len = max(args.contexts) + 2 * BLOCK
    model = long_context_model(args.model, positions=max(4096, 2 * max_len))
    try:
        pool_bytes = 2 * args.repeats * sum(args.contexts) * 2048 + (8 << 20)  # never evicts
        region = None
        if args.shared_memory:
            from tokenflow.kv_offload.host_shm import PoolFile

            node_pool = PoolFile("/dev/shm", f"bench-{os.getpid()}", pool_bytes)
            region = node_pool.region(0, pool_bytes)
        llm = make_engine(model, max_len, pool_bytes, region)
        pool = host_pool_of(llm.llm_engine.engine_core.engine_core.scheduler.connector)
        rng = np.random.default_rng(0)
        timed_generate(llm, rng.integers(4, 1500, 64).tolist())  # warm-up
        for context in args.contexts:
            print(json.dumps(measure(llm, pool, context, args.repeats, rng)), flush=True)
        print(json.dumps({"counters": pool.counters.as_dict()}), flush=True)
    finally:
        shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
