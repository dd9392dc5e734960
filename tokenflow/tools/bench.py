"""`tokenflow bench`: one workload, each scheduler in turn, side by side.

Tokens are timed inside the process that steps the engine (vLLM's LLMEngine
in-process, no HTTP, no IPC): on a 2-core machine the Serve path adds
seconds of client-side noise, so this is where the comparison is cleanest.
The summary says so in `workload.timing`. Every figure comes from the same
buffer model the server and the load test use (tokenflow/core/buffer.py).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tokenflow.core.buffer import ReaderBuffer
from tokenflow.tools.bench_drive import EngineRun, WallClock, WorkClock

SCHEDULERS = ("fcfs", "andes", "tokenflow")
# TokenFlow's class for each scheduling mode; fcfs is vLLM's own scheduler
# (AsyncScheduler or Scheduler, as vLLM picks it for the mode).
TF_CLASS = {"sync": "tokenflow.engine.scheduler.TokenFlowScheduler",
            "async": "tokenflow.engine.scheduler.TokenFlowAsyncScheduler"}
SCHEDULING = ("auto", "sync", "async")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def resolve_scheduling(mode: str) -> str:
    """"auto": asynchronous where the platform runs it (CUDA-like GPUs, where
    vLLM turns it on by default), synchronous elsewhere (vLLM's CPU build
    forces it off). Every scheduler in one bench runs in the same mode."""
    if mode not in SCHEDULING:
        raise ValueError(f"unknown scheduling {mode!r}; choose one of {SCHEDULING}")
    if mode != "auto":
        return mode
    from vllm.platforms import current_platform

    return "async" if current_platform.is_cuda_alike() else "sync"


@dataclass
class Workload:
    kind: str = "burst"  # burst | poisson | gamma
    requests: int = 128
    poisson_rate: float = 8.0  # requests/s when kind is poisson or gamma
    # Gamma arrivals: the gaps' coefficient of variation (1 = Poisson; more
    # is burstier), at the same mean rate.
    gamma_cv: float = 2.0
    rates: list[float] = field(default_factory=lambda: [10.0, 20.0, 40.0])  # reading rates, drawn uniformly
    prompt_tokens: int = 64
    output_tokens: int = 1024
    seed: int = 0

    def arrivals(self) -> list[float]:
        if self.kind == "burst":
            return [0.0] * self.requests
        if self.kind in ("poisson", "gamma"):
            rng, t, out = random.Random(self.seed), 0.0, []
            shape = 1.0 / self.gamma_cv ** 2  # gamma gaps with this CV and mean 1/rate
            for _ in range(self.requests):
                out.append(t)
                if self.kind == "poisson":
                    t += rng.expovariate(self.poisson_rate)
                else:
                    t += rng.gammavariate(shape, 1.0 / (shape * self.poisson_rate))
            return out
        raise ValueError(f"unknown workload kind {self.kind!r} (burst, poisson or gamma)")

    def at_load(self, load: float, decode_tps: float) -> "Workload":
        """The same workload sized to a share of the engine's measured decode
        capacity, so one command means the same contention on any machine.
        A burst: as many readers as together read `load` x capacity. Poisson
        or gamma: arrivals whose tokens come at `load` x capacity."""
        mean_rate = statistics.fmean(self.rates)
        if self.kind == "burst":
            return replace(self, requests=max(1, round(load * decode_tps / mean_rate)))
        return replace(self, poisson_rate=load * decode_tps / self.output_tokens)

    def reading_rates(self) -> list[float]:
        rng = random.Random(self.seed + 1)
        return [rng.choice(self.rates) for _ in range(self.requests)]

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed + 2)
        return [[rng.randrange(10, 1000) for _ in range(self.prompt_tokens)] for _ in range(self.requests)]


@dataclass
class EngineSettings:
    model: str = "models/tiny-llama"
    kv_cache_memory_bytes: int | None = 32 << 20  # small: the default burst does not fit
    max_num_seqs: int = 32
    max_model_len: int = 2048
    block_size: int | None = 32
    # Host KV tier (tokenflow/kv_offload/) for every scheduler alike; 0: none.
    offload_bytes: int = 256 << 20
    extra: dict = field(default_factory=dict)  # any other vLLM engine args
    # TokenFlowConfig overrides. dt 0.1 s: the tiny CPU model decodes a
    # request about 10x faster than an 8B model on a GPU, so the paper's
    # 0.5-1.5 s interval shrinks with it.
    tokenflow: dict = field(default_factory=lambda: {"dt": 0.1})
    scheduling: str = "auto"  # auto | sync | async: the mode of every scheduler

    def engine_kwargs(self, scheduler: str) -> dict:
        mode = resolve_scheduling(self.scheduling)
        kw = dict(model=self.model, enforce_eager=True, seed=0, max_num_seqs=self.max_num_seqs,
                  max_model_len=self.max_model_len, disable_log_stats=True,
                  async_scheduling=mode == "async")
        if self.kv_cache_memory_bytes:
            kw["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.block_size:
            kw["block_size"] = self.block_size
        if _on_cpu():
            # vLLM's CPU build: the tiny model's own float32, not a bf16
            # downcast (AMX attention kernels die with SIGILL in VMs that
            # report AMX without enabling it).
            kw["dtype"] = "float32"
        if self.offload_bytes:
            from tokenflow.kv_offload import kv_transfer_config

            kw["kv_transfer_config"] = kv_transfer_config(host_pool_bytes=self.offload_bytes, tokenflow_connector=True)
        kw.update(self.extra)
        if scheduler != "fcfs":
            kw["scheduler_cls"] = TF_CLASS[mode]
            kw["additional_config"] = {"tokenflow": {**self.tokenflow, "policy": scheduler}}
        return kw


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_engine(scheduler: str, eng: EngineSettings):
    """An in-process LLMEngine for one scheduler, warmed up."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(**eng.engine_kwargs(scheduler))
    engine = llm.llm_engine
    want = resolve_scheduling(eng.scheduling)
    got = "async" if engine.vllm_config.scheduler_config.async_scheduling else "sync"
    if got != want:  # e.g. async asked for on vLLM's CPU build, which turns it off
        raise RuntimeError(f"{scheduler}: vLLM runs {got} scheduling on this platform, not {want}")
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


@contextmanager
def collector_frozen():
    """What is alive now stays for the run: out of the collector's way, as a
    vLLM server's EngineCore puts its start-up heap. Otherwise a full
    collection over it (and over what earlier engines of this process
    left) stops the step loop for 0.3-0.5 s at random, in any scheduler's run."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_one(scheduler: str, wl: Workload, eng: EngineSettings) -> tuple[list[ReaderBuffer], float, list[dict], dict | None]:
    """Drive one engine through the workload alone; returns readers, wall time, records, scheduler stats."""
    llm = start_engine(scheduler, eng)
    with collector_frozen():
        run = EngineRun(llm.llm_engine, wl, WallClock())
        while not run.done:
            run.turn()
        result = outcome(run)
    del llm, run
    gc.collect()
    return result


def run_lockstep(schedulers, wl: Workload, eng: EngineSettings) -> dict[str, tuple]:
    """Every scheduler's engine in this process at once, taking turns of one
    step each, each on its own WorkClock (bench_drive.py): the engine whose
    clock is furthest behind goes next. Returns what run_one does, per
    scheduler; its wall time is its clock's."""
    from vllm.distributed.kv_transfer import kv_transfer_state as kv_state

    llms, agents, runs = {}, {}, {}
    # A worker's KV connector lives in a global of its process (a served
    # engine's worker has a process to itself); here each engine keeps its
    # own and puts it in place for its turns.
    for name in schedulers:
        kv_state._KV_CONNECTOR_AGENT = None
        llms[name] = start_engine(name, eng)
        agents[name] = kv_state._KV_CONNECTOR_AGENT
        clock = WorkClock()
        sched = llms[name].llm_engine.engine_core.engine_core.scheduler
        if hasattr(sched, "set_clock"):  # TokenFlow's reads its readers' buffers on the engine's own timeline
            sched.set_clock(clock.now)
        runs[name] = EngineRun(llms[name].llm_engine, wl, clock)
    with collector_frozen():
        while live := [name for name in schedulers if not runs[name].done]:
            name = min(live, key=lambda n: runs[n].clock.now())
            kv_state._KV_CONNECTOR_AGENT = agents[name]
            runs[name].turn()
    result = {name: outcome(run) for name, run in runs.items()}
    for name in schedulers:  # each engine shuts down with its own connector in place
        kv_state._KV_CONNECTOR_AGENT = agents[name]
        del llms[name], runs[name]
        gc.collect()
    kv_state._KV_CONNECTOR_AGENT = None
    return result


def outcome(run: EngineRun) -> tuple[list[ReaderBuffer], float, list[dict], dict | None]:
    """A finished run's readers, wall time (on its clock), records and scheduler stats."""
    wall = run.clock.now()
    return list(run.readers.values()), wall, run.records(wall), scheduler_stats(run.engine)


def scheduler_stats(engine) -> dict | None:
    """TokenFlow's counters (pauses, resumes, recompute) from the in-process
    engine core; None for vLLM's own scheduler."""
    sched = engine.engine_core.engine_core.scheduler
    stats = getattr(sched, "tf_stats", None)
    return None if stats is None else asdict(stats)


def calibrate(eng: EngineSettings, tokens: int = 256, passes: int = 3) -> dict:
    """Decode capacity of the engine: vLLM's own scheduler decoding a full
    batch (max_num_seqs requests) with no prefill, the steps after the
    first tokens timed; the best of a few passes (a pass that another
    process slowed says less about the engine than the fastest one)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(**eng.engine_kwargs("fcfs"))
    engine = llm.llm_engine
    rng = random.Random(7)
    batch = eng.max_num_seqs
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    passes_tps = []
    for p in range(passes):
        for i in range(batch):
            prompt = [rng.randrange(10, 1000) for _ in range(16)]
            engine.add_request(f"cal-{p}-{i}", {"prompt_token_ids": prompt}, sp)
        for _ in range(3):  # prefill, first tokens, warm-up
            engine.step()
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            engine.step()
        passes_tps.append(batch * (tokens - 3) / (time.monotonic() - t0))
    del llm, engine
    gc.collect()
    return {"decode_tps": max(passes_tps), "passes_tps": passes_tps, "batch": batch,
            "method": "vLLM's scheduler decoding max_num_seqs requests, no prefill, engine-side timing, "
                      "best pass"}


# ratio name -> the result field it divides (tokenflow's over fcfs's)
RATIO_KEYS = {"ttft_p99": "ttft_p99_s", "effective_throughput": "effective_throughput_tps",
              "throughput": "throughput_tps"}


def ratios(results: dict, keys: dict = RATIO_KEYS) -> dict | None:
    """TokenFlow's figures over fcfs's, from one run; None unless both ran."""
    if "fcfs" not in results or "tokenflow" not in results:
        return None
    f, t = results["fcfs"], results["tokenflow"]
    return {name: t[k] / f[k] if f.get(k) and t.get(k) is not None else None for name, k in keys.items()}


def summarize(rounds: list[tuple[list[ReaderBuffer], float]], expected: int) -> dict:
    """One scheduler's figures over its rounds, each (readers, wall):
    percentiles over every request of every round, throughputs as tokens
    over the rounds' summed walls."""
    readers = [r for rs, _ in rounds for r in rs]
    wall = sum(w for _, w in rounds)
    done = [r for r in readers if r.finished and r.delivered == expected]
    ttfts = [r.ttft for r in readers if r.ttft is not None]
    tbts = [x for r in readers for x in r.tbts()]
    tokens = sum(r.delivered for r in readers)
    return {
        "completed": len(done),
        "failed": len(readers) - len(done),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tbt_p99_s": percentile(tbts, 0.99),
        "stall_s_mean": statistics.fmean(r.stall_time(w) for rs, w in rounds for r in rs),
        "throughput_tps": tokens / wall,
        "effective_throughput_tps": sum(r.effective_tokens() for r in readers) / wall,
        "qoe_mean": statistics.fmean(r.qoe() for r in readers),
        "wall_s": wall,
    }


def combine_stats(per_round: list[dict | None]) -> dict | None:
    """A scheduler's counters over its rounds (an engine each): totals,
    and the largest of the `max_` fields."""
    if not per_round or per_round[0] is None:
        return None
    return {k: (max if k.startswith("max_") else sum)(st[k] for st in per_round) for k in per_round[0]}


def paired_ttft(ttfts: dict) -> dict | None:
    """Each request's first token under tokenflow minus under fcfs, where
    both saw it arrive at the same time: in lockstep (each engine on its own
    clock) or with the apps served together (`bench-app --together`). A
    P99 over a few hundred first tokens is set by a handful of steps that
    happened to be slow on one side; the pairs say whether the same
    requests come later. `ttfts`: policy -> request id -> seconds. None
    unless both ran."""
    f, t = ttfts.get("fcfs"), ttfts.get("tokenflow")
    if not f or not t:
        return None
    diffs = [t[k] - f[k] for k in f if t.get(k) is not None and f[k] is not None]
    if not diffs:
        return None
    return {"requests": len(diffs), "mean_s": statistics.fmean(diffs),
            **{f"p{q}_s": percentile(diffs, q / 100) for q in (1, 50, 99)}}


def run_order(names, seed: int) -> list[str]:
    """The schedulers (or the app's policies) in the order they run: rotated
    by the seed, so that over seeds 0, 1, 2 each goes first once. On this
    CPU the first to run had the worst P99 TTFT in 15 of 20 light-load
    runs, whatever it was (with the order reversed TokenFlow's went from
    0.73x fcfs's to 1.78x), and a machine drifts over a bench."""
    names = list(names)
    k = seed % len(names)
    return names[k:] + names[:k]


def run_bench(out_dir: str, wl: Workload, eng: EngineSettings, schedulers=SCHEDULERS, plots: bool = True,
              load: float | None = None, rounds: int = 1, lockstep: bool = False) -> dict:
    """Each scheduler in turn on the same workload. With `load`, the
    workload is first sized to that share of the measured capacity.

    With `rounds` > 1 the schedulers take turns that many times, each round
    a new workload (seed + round) that every scheduler runs on a fresh
    engine, the order rotated each round, and each scheduler's figures
    pooled over its rounds: a VM that drifts over minutes then slows every
    scheduler alike, and a P99 is taken over more first tokens. The plots
    show the first round.

    With `lockstep` the schedulers of a round run at once, in turns of one
    engine step each, each on the clock of its own engine's work
    (bench_drive.py): what a slow minute of the machine does, it does to
    every scheduler's steps alike. Times are then seconds of engine work,
    not of the wall. CPU backend only."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if lockstep and not _on_cpu():
        # Unmeasured there, and not sound: the engines would share one
        # device's memory, and under async scheduling one engine's batch in
        # flight would run on through the other's turn, off its own clock.
        raise ValueError("--lockstep runs on vLLM's CPU backend only (it pairs engines that share a CPU); "
                         "on an accelerator, use --rounds")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    calibration = None
    if load is not None:
        calibration = calibrate(eng)
        wl = wl.at_load(load, calibration["decode_tps"])
        calibration["load"] = load
        print(json.dumps({"calibration": calibration, "requests": wl.requests,
                          "arrival_rate": wl.poisson_rate if wl.kind != "burst" else None}), flush=True)
    for name in schedulers:
        if name not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {name!r}; choose from {SCHEDULERS}")
    played = {name: [] for name in schedulers}  # (readers, wall) per round
    figures = {name: [] for name in schedulers}  # each round's summary
    stats = {name: [] for name in schedulers}
    first_records, orders = {}, []
    ttfts = {name: {} for name in schedulers}  # (round, request id) -> TTFT, for the lockstep pairing
    for k in range(rounds):
        order = run_order(schedulers, wl.seed + k)
        orders.append(order)
        round_wl = replace(wl, seed=wl.seed + k)
        if lockstep:
            played_now = run_lockstep(order, round_wl, eng).items()
        else:  # one after another, each summary printed as it ends
            played_now = ((name, run_one(name, round_wl, eng)) for name in order)
        for name, (readers, wall, records, st) in played_now:
            played[name].append((readers, wall))
            figures[name].append(summarize([(readers, wall)], wl.output_tokens))
            stats[name].append(st)
            with open(out / f"requests-{name}.jsonl", "w" if k == 0 else "a") as f:
                for rec in records:
                    f.write(json.dumps({**rec, "round": k}) + "\n")
            if k == 0:
                first_records[name] = records
            ttfts[name].update(((k, rec["id"]), rec["ttft_s"]) for rec in records)
            print(json.dumps({"scheduler": name, "round": k, **figures[name][-1]}), flush=True)
    results = {}
    for name in schedulers:
        results[name] = summarize(played[name], wl.output_tokens)
        results[name]["scheduler_stats"] = combine_stats(stats[name])
        if rounds > 1:
            results[name]["rounds"] = figures[name]
    summary = {
        "workload": {**asdict(wl), "engine": {**asdict(eng), "scheduling": resolve_scheduling(eng.scheduling)},
                     "timing": "engine-side: tokens timed in the process stepping vLLM's LLMEngine (no HTTP)"
                               + ("; lockstep: the engines took turns of a step each, each timed on the clock "
                                  "of its own work" if lockstep else ""),
                     "lockstep": lockstep,
                     "calibration": calibration, "order": orders[0], "rounds": rounds,
                     "round_orders": orders},
        "results": results,
    }
    if lockstep and (paired := paired_ttft(ttfts)) is not None:
        summary["paired_ttft_tokenflow_minus_fcfs"] = paired
        print(json.dumps({"paired_ttft_tokenflow_minus_fcfs": paired}), flush=True)
    if (r := ratios(results)) is not None:
        summary["ratios_tokenflow_vs_fcfs"] = r
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if plots:
        from tokenflow.tools.bench_plots import write_plots

        write_plots(out, first_records, wl)
    return summary
