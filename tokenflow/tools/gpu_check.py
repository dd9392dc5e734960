"""`tokenflow gpu-check`: the one script a GPU machine runs to check the
GPU path (scripts/gpu_check.sh). No download:

1. a Llama-3-8B-shaped model with seeded random weights, made locally
   (bf16, about 16 GB; reused when present);
2. an engine burst that overfills sequence slots and KV, with the CUDA host
   KV tier (tokenflow/kv_offload/: pinned slot, copy streams), once under vLLM's stock
   scheduler and once under `TokenFlowAsyncScheduler`, both with vLLM's
   async scheduling and batch-invariant kernels; it checks that TokenFlow
   paused requests (with steps in flight) and that every greedy output
   equals stock vLLM's;
3. `tokenflow bench` at the paper's H200 burst setting (400 requests at
   once), all three schedulers in async mode.

It prints one JSON summary and exits non-zero when a check fails.
`--tiny` runs the same path on CPU with the tiny model (synchronous
scheduling there), which is how the suite keeps this script working.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def make_model(args) -> str:
    from tokenflow.tools.tiny_model import LLAMA3_8B_SHAPE, make_random_llama, make_tiny_model

    if args.tiny:
        return str(make_tiny_model(args.model_dir or "models/tiny-llama"))
    return str(make_random_llama(args.model_dir or "models/llama3-8b-random", LLAMA3_8B_SHAPE,
                                 dtype="bfloat16", device="cuda", name="llama3-8b-random"))


def engine_args(args, model: str, scheduler_cls: str | None) -> dict:
    from tokenflow.kv_offload import kv_transfer_config

    kw = dict(model=model, seed=0, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enforce_eager=True, disable_log_stats=True, async_scheduling=not args.tiny,
              kv_transfer_config=kv_transfer_config(host_pool_bytes=args.offload_bytes))
    if args.tiny:
        kw["dtype"] = "float32"  # as tokenflow bench on CPU
    if args.kv_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_bytes
    if scheduler_cls:
        kw["scheduler_cls"] = scheduler_cls
        kw["additional_config"] = {"tokenflow": {"dt": args.dt}}
    return kw


def engine_burst(args, model: str, scheduler_cls: str | None) -> tuple[list[list[int]], dict]:
    """One in-process engine, one burst; the tokens of every request and
    what the scheduler counted."""
    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]}
               for _ in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True,
                             extra_args={"consumption_rate": rng.choice((10.0, 20.0, 40.0))})
              for _ in prompts]
    llm = LLM(**engine_args(args, model, scheduler_cls))
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    info = {"wall_s": round(time.monotonic() - t0, 2),
            "async_scheduling": bool(sched.scheduler_config.async_scheduling),
            "kv_blocks": sched.kv_cache_config.num_blocks}
    if hasattr(sched, "tf_stats"):
        s = sched.tf_stats
        info.update(pauses_hold=s.pauses_hold, pauses_release=s.pauses_release,
                    pauses_in_flight=s.pauses_in_flight, pauses_skipped=s.pauses_skipped,
                    resumes=s.resumes, tokens_recomputed=s.tokens_recomputed)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs, core, sched
    _free_engine()
    return tokens, info


def _free_engine() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_bench(args, model: str) -> dict:
    from tokenflow.tools.bench import EngineSettings, Workload
    from tokenflow.tools.bench import run_bench as bench

    wl = Workload(requests=args.bench_requests, prompt_tokens=args.prompt_tokens,
                  output_tokens=args.bench_output_tokens)
    eng = EngineSettings(model=model, kv_cache_memory_bytes=args.kv_bytes or None,
                         max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         block_size=None, offload_bytes=args.offload_bytes,
                         tokenflow={"dt": args.dt}, scheduling="sync" if args.tiny else "async")
    summary = bench(str(Path(args.out) / "bench"), wl, eng, plots=False)
    return {"results": summary["results"], "ratios": summary.get("ratios_tokenflow_vs_fcfs"),
            "scheduling": summary["workload"]["engine"]["scheduling"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenflow gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU dry run with the tiny model")
    p.add_argument("--out", default="out/gpu-check")
    p.add_argument("--model-dir")
    p.add_argument("--requests", type=int, default=512, help="engine burst size")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-bytes", type=int, default=8 << 30,
                   help="device KV pool: small enough that the burst does not fit")
    p.add_argument("--offload-bytes", type=int, default=32 << 30)
    p.add_argument("--dt", type=float, default=0.5)
    p.add_argument("--bench-requests", type=int, default=400)
    p.add_argument("--bench-output-tokens", type=int, default=1024)
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    if not args.tiny:
        # Greedy equality across different batch shapes needs vLLM's
        # batch-invariant kernels on a GPU.
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read the scheduler in-process
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = make_model(args)
    summary: dict = {"model": model, "model_s": round(time.monotonic() - t0, 1)}
    tf_cls = "tokenflow.engine.scheduler." + ("TokenFlowScheduler" if args.tiny else "TokenFlowAsyncScheduler")
    stock, summary["stock"] = engine_burst(args, model, None)
    mine, summary["tokenflow"] = engine_burst(args, model, tf_cls)
    tf = summary["tokenflow"]
    checks = {
        "async_scheduling": tf["async_scheduling"] == (not args.tiny) == summary["stock"]["async_scheduling"],
        "paused": tf["pauses_hold"] + tf["pauses_release"] > 0,
        "paused_in_flight": args.tiny or tf["pauses_in_flight"] > 0,
        "outputs_equal_stock": mine == stock,
    }
    summary["mismatched_requests"] = sum(a != b for a, b in zip(mine, stock))
    if not args.skip_bench:
        summary["bench"] = run_bench(args, model)
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    summary["total_s"] = round(time.monotonic() - t0, 1)
    text = json.dumps(summary, indent=2)
    (Path(args.out) / "summary.json").write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
