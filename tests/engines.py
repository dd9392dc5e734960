"""Real vLLM engines for tests, in-process so tests can read the scheduler.

The tiny model has real (seeded random) weights, so outputs depend on the
whole KV history; the pool is small so a burst does not fit."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-llama")

# Two requests' worth of pressure: 32 blocks of 32 tokens.
SMALL_POOL = dict(kv_cache_memory_bytes=2 << 20, block_size=32, max_model_len=512, max_num_seqs=16)


def ensure_model() -> str:
    from tokenflow.tools.tiny_model import make_tiny_model

    make_tiny_model(MODEL)
    return MODEL


@contextmanager
def inproc_env():
    old = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_llm(scheduler_cls: str | None = None, tokenflow: dict | None = None, **overrides):
    from vllm import LLM

    kw = dict(model=ensure_model(), enforce_eager=True, seed=0, dtype="float32", **SMALL_POOL)
    kw.update(overrides)
    if scheduler_cls:
        kw["scheduler_cls"] = scheduler_cls
        kw["additional_config"] = {"tokenflow": tokenflow or {}}
    with inproc_env():
        return LLM(**kw)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def drain(llm, max_steps: int = 1000) -> int:
    """Step the engine until its scheduler has nothing left, as a server's
    engine loop does. LLM.generate returns once every output is final, but
    write-through started by the last steps completes only on later steps
    (vLLM keeps stepping for it: `has_pending_push_work`). Returns the steps."""
    core = llm.llm_engine.engine_core.engine_core
    for n in range(max_steps):
        if not core.scheduler.has_requests():
            return n
        core.step()
    raise AssertionError(f"engine still busy after {max_steps} steps")


def burst_prompts(n: int = 24) -> list[str]:
    return [f"Question {i}: the reader stream buffer {i * 7} when river mountain" for i in range(n)]
