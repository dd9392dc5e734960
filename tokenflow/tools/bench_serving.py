"""`tokenflow bench-serving`: what the serving path costs per streamed token,
TokenFlow's app beside stock Ray Serve LLM.

One `serve run` holds both apps, so they share the Ray cluster, the HTTP
proxy and the machine's moment: TokenFlow's app from the config at `/`, and
stock Ray Serve LLM (`ray.serve.llm:build_openai_app`) at `/stock` with the
same engines (model, engine arguments, replicas, KV size, environment) and
nothing of TokenFlow (vLLM's own scheduler, no host KV tier, Serve's request
router). Each round sends the same burst to each app in turn (alternating
which goes first): streaming chat answers that state no reading rate and
all fit in the engines' slots, so no scheduling policy has anything to do
and what differs is the serving path.

Around each burst the bench reads the CPU time of every process of the
cluster and of itself, and books it by role (roles()): CPU seconds per
1,000 streamed tokens for the proxy, the ingress, the engine replica, the
engine core, the model workers, TokenFlow's router actor and KV pool actor,
Serve's controller, Ray's own processes and the client; beside them output
throughput and TTFT from the client's token times. The processes of the
other app (idle during the burst) are left out.

Some of that CPU is spent per second whether tokens stream or not (state
pushes, long polls, metrics, health checks), and the rest per token. Before
the bursts, with both apps idle, the bench reads each role's idle CPU per
second (read again, a few times at most, while an engine still works);
each burst then also reports its CPU beyond that rate times its length,
per 1,000 tokens: what a token costs a layer, apart from what the layer
costs per second (a lower bound of the time-based part: under load
the same loops carry larger states). The first scales with a machine's
token rate, the second does not.

Ray Serve LLM sends a stream's tokens in messages, one per
`stream_batching_interval_ms`, so a slower stream sends fewer tokens per
message, and every layer a message crosses then costs more per token. The
bench counts the messages as the client saw them (a stream's tokens that
arrive together) and also reports our layers' CPU per message.

`--together` sends each round's two bursts at the same moment instead, so
that both apps meet the same machine: on a VM whose speed drifts between
bursts, the ratios then compare two apps under one condition rather than
two moments. Each app's processes are booked to it as before; what both
share (the proxy, the controller, Ray's own processes, the one client)
goes into a `shared` entry of the round instead of either app's row.

OUT gets app.yaml (what was served), serve.log, summary.json.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from tokenflow.serve.routing.board import DetachedBoard
from tokenflow.serve.routing.relay import RelayActor
from tokenflow.tools import launcher
from tokenflow.tools.bench import percentile
from tokenflow.tools.bench_app import ServedApp, app_config, bench_paths, received_by_engine, share_bundles
from tokenflow.tools.loadtest import http_reader

OURS, STOCK = "tokenflow", "stock"
STOCK_PREFIX = "/stock"
# The roles each app's own layers are made of (the "our layers"
# against stock Ray Serve LLM's ingress and replica).
OWN_LAYERS = {OURS: ("ingress", "replica", "router", "pool"), STOCK: ("ingress", "replica")}
ROLES = ("proxy", "ingress", "replica", "engine_core", "model_workers", "router", "pool", "controller",
         "ray_system", "client")
# Roles whose processes serve both apps (and the bench's one client).
SHARED_ROLES = ("proxy", "controller", "ray_system", "client")
_REPLICA = re.compile(r"ServeReplica:([^:\s]+):([A-Za-z0-9_]+)")


# --- the two apps in one config -------------------------------------------------------

def stock_app(ours: dict, name: str = STOCK, route_prefix: str = STOCK_PREFIX) -> dict:
    """A `serve run` application entry of stock Ray Serve LLM with the same
    engines as our app entry `ours` (its args resolved as our builder does)."""
    from tokenflow.serve import app as tf_app

    a = tf_app.resolve_args(ours["args"])
    engine_kwargs = {k: v for k, v in a["engine_kwargs"].items()
                     if k not in ("scheduler_cls", "additional_config", "kv_transfer_config")}
    deployment = copy.deepcopy(a["deployment_config"])
    deployment.pop("request_router_config", None)
    deployment["num_replicas"] = a["num_replicas"]
    if a["replica_num_cpus"] is not None:
        deployment.setdefault("ray_actor_options", {})["num_cpus"] = a["replica_num_cpus"]
    llm = {"model_loading_config": {"model_id": a["model_id"],
                                    "model_source": tf_app.resolve_model_path(a["model_path"])},
           "engine_kwargs": engine_kwargs, "accelerator_config": {"kind": a["accelerator"]},
           "deployment_config": deployment, "experimental_configs": a["experimental_configs"],
           "runtime_env": {"env_vars": {k: str(v) for k, v in a["env"].items()}}}
    if a["placement_group_config"] is not None:
        llm["placement_group_config"] = copy.deepcopy(a["placement_group_config"])
    if a["accelerator_type"] is not None:
        llm["accelerator_type"] = a["accelerator_type"]
    ingress = {"num_replicas": a["ingress_replicas"]}
    if a["ingress_num_cpus"] is not None:
        ingress["ray_actor_options"] = {"num_cpus": a["ingress_num_cpus"]}
    return {"name": name, "route_prefix": route_prefix, "import_path": "ray.serve.llm:build_openai_app",
            "args": {"llm_configs": [llm], "ingress_deployment_config": ingress}}


def combined_config(config: Path, port: int, requests: int, engines: int | None, app_args: dict | None = None) -> dict:
    doc = app_config(config, _policy_of(config), port, requests, engines, {})
    ours = doc["applications"][0]
    _merge(ours["args"], app_args or {})
    if ours.get("route_prefix", "/") != "/":
        raise ValueError("bench-serving serves the config's app at route_prefix /")
    from tokenflow.serve import app as tf_app

    resolved = tf_app.resolve_args(ours["args"])
    ours["args"]["placement_group_config"] = copy.deepcopy(resolved["placement_group_config"])
    stock = stock_app(ours)
    share_bundles(ours, 0.5)
    share_bundles(stock, 0.5)
    doc["applications"] = [ours, stock]
    return doc


def _merge(into: dict, extra: dict) -> None:
    """Deep-merge `extra` into `into` (dicts merge, anything else replaces)."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def _policy_of(config: Path) -> str:
    args = (yaml.safe_load(config.read_text()) or {})["applications"][0].get("args") or {}
    return (args.get("tokenflow") or {}).get("policy", "tokenflow")


# --- CPU by role ----------------------------------------------------------------------

@dataclass(frozen=True)
class Proc:
    pid: int
    app: str | None  # None: shared by both apps (proxy, controller, Ray)
    role: str


def roles(session: int, our_app: str) -> list[Proc]:
    """Every process of the `serve run` session, with its app and role."""
    procs = {}
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        try:
            if p.pid != session and os.getsid(p.pid) != session:
                continue
            procs[p.pid] = (p.info["ppid"], " ".join(p.info["cmdline"] or ()) or p.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    replicas = {}  # pid -> (app, role) of Serve replicas
    for pid, (_, cmd) in procs.items():
        if m := _REPLICA.search(cmd):
            replicas[pid] = (m.group(1), "ingress" if "Ingress" in m.group(2) else "replica")
    out = []
    for pid, (ppid, cmd) in procs.items():
        if pid in replicas:
            app, role = replicas[pid]
        elif (owner := _replica_ancestor(pid, procs, replicas)) is not None:
            app, role = replicas[owner][0], "engine_core" if "EngineCore" in cmd else "model_workers"
        elif cmd.startswith("ray::ProxyActor"):
            app, role = None, "proxy"
        elif cmd.startswith("ray::ServeController"):
            app, role = None, "controller"
        elif cmd.startswith((f"ray::{DetachedBoard.__name__}", f"ray::{RelayActor.__name__}")):
            app, role = our_app, "router"  # the state board (and node relays, when on)
        elif cmd.startswith("ray::KVPoolActor"):
            app, role = our_app, "pool"
        else:
            app, role = None, "ray_system"
        out.append(Proc(pid, app, role))
    return out


def _replica_ancestor(pid: int, procs: dict, replicas: dict) -> int | None:
    seen = 0
    while pid in procs and seen < 8:
        pid = procs[pid][0]
        if pid in replicas:
            return pid
        seen += 1
    return None


def cpu_seconds(procs: list[Proc]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = psutil.Process(p.pid).cpu_times()
            out[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def by_role(procs: list[Proc], before: dict[int, float], after: dict[int, float], app: str | None,
            shared: bool = True) -> dict[str, float]:
    """CPU seconds per role spent between the readings by `app`'s processes
    and (`shared`) the ones both apps share (without: no entry for their
    roles); app None: the shared ones alone."""
    out = dict.fromkeys(ROLES if shared or app is None else [r for r in ROLES if r not in SHARED_ROLES], 0.0)
    for p in procs:
        if not (p.app == app or (shared and p.app is None)) or p.pid not in after:
            continue
        out[p.role] += after[p.pid] - before.get(p.pid, 0.0)
    return out


# --- one burst ------------------------------------------------------------------------

# The client's reader model only: it reads as fast as tokens come.
CLIENT_RATE = 10000.0


def burst_bodies(model: str, requests: int, max_tokens: int) -> list[dict]:
    """`requests` streaming chat bodies that state no reading rate (stock
    Ray Serve LLM knows none; TokenFlow assumes its default) and ask for
    usage at the end only, as a client that does not know TokenFlow sends
    them (vLLM's own benchmark client does)."""
    bodies = []
    for i in range(requests):
        body = http_reader.chat_body(model, f"Tell the story of reader {i}.", max_tokens, CLIENT_RATE)
        body.pop("consumption_rate")
        body["stream_options"] = {"include_usage": True}
        bodies.append(body)
    return bodies


def _schedule(base_url: str, bodies: list[dict], timeout: float):
    n = len(bodies)
    return http_reader.run_schedule(base_url, bodies, [CLIENT_RATE] * n, [0.0] * n, timeout, None,
                                    launcher.api_key_from_env())


def burst(base_url: str, model: str, requests: int, max_tokens: int, timeout: float) -> list[dict]:
    """`requests` streaming answers at once (burst_bodies)."""
    return asyncio.run(_schedule(base_url, burst_bodies(model, requests, max_tokens), timeout))


def bursts(urls: dict[str, str], model: str, requests: int, max_tokens: int, timeout: float) -> dict[str, list[dict]]:
    """The same burst to every app of `urls` (name -> base URL) at the same
    moment, from one client; records by app."""
    bodies = burst_bodies(model, requests, max_tokens)

    async def all_apps():
        return await asyncio.gather(*(_schedule(url, bodies, timeout) for url in urls.values()))

    return dict(zip(urls, asyncio.run(all_apps())))


# Ray Serve LLM sends a stream's tokens in messages, one per
# `stream_batching_interval_ms` (50 ms by default) with whatever the engine
# made meanwhile, so a layer's CPU per token follows the tokens per message,
# i.e. how fast each stream goes. The client sees a message's tokens arrive
# together: arrivals further apart than this start a new one.
MESSAGE_GAP_S = 0.005


def messages(arrivals: list[float]) -> int:
    """How many messages one stream's token arrival times came in."""
    return (1 + sum(b - a > MESSAGE_GAP_S for a, b in zip(arrivals, arrivals[1:]))) if arrivals else 0


# An engine whose core and model workers spend more than this (CPU seconds
# per second, per engine) is still working: a warm-up's tail, a compile. Idle
# they measured 0.01-0.04 here; readings taken while stock's still worked
# read 0.2-0.5 for its model workers, and booked that work as idle.
ENGINE_IDLE_CPU_S_PER_S = 0.1


def engines_idle(procs: list[Proc], rates: dict[str, dict[str, float]]) -> bool:
    """Whether every app's engines (cores and model workers) were idle in a
    reading of `rates` (idle_rates' form)."""
    for app in (OURS, STOCK):
        engines = sum(p.app == app and p.role == "replica" for p in procs) or 1
        if rates[app]["engine_core"] + rates[app]["model_workers"] > ENGINE_IDLE_CPU_S_PER_S * engines:
            return False
    return True


def idle_rates(procs: list[Proc], seconds: float,
               tries: int = 6) -> tuple[dict[str, dict[str, float]], int, bool]:
    """Each app's CPU seconds per second by role while nothing streams, the
    readings it took, and whether the last found every engine idle: readings
    of `seconds` each until one does (engines_idle), `tries` at most (the
    last one stands then)."""
    for n in range(1, tries + 1):
        before = cpu_seconds(procs)
        time.sleep(seconds)
        after = cpu_seconds(procs)
        rates = {app: {k: v / seconds for k, v in by_role(procs, before, after, app).items()} for app in (OURS, STOCK)}
        if settled := engines_idle(procs, rates):
            break
    return rates, n, settled


def beyond_idle(cpu: dict[str, float], idle: dict[str, float], wall: float, tokens: int) -> dict[str, float | None]:
    """CPU seconds per 1,000 tokens each role spent over its idle rate."""
    return {k: 1000 * (v - idle.get(k, 0.0) * wall) / tokens if tokens else None for k, v in cpu.items()}


def measure(app: str, base_url: str, model: str, procs: list[Proc], requests: int, max_tokens: int,
            timeout: float, idle: dict[str, float] | None = None) -> dict:
    """One burst to `app` alone; its row."""
    routed0 = received_by_engine(base_url, pushed_after=time.time()) if app == OURS else {}
    before, client0, t0 = cpu_seconds(procs), time.process_time(), time.monotonic()
    records = burst(base_url, model, requests, max_tokens, timeout)
    wall, client = time.monotonic() - t0, time.process_time() - client0
    after = cpu_seconds(procs)
    cpu = by_role(procs, before, after, app)
    cpu["client"] = client
    return row_of(app, records, cpu, wall, requests, idle, _routed(app, base_url, routed0))


def measure_together(urls: dict[str, str], model: str, procs: list[Proc], requests: int, max_tokens: int,
                     timeout: float, idle: dict[str, dict[str, float]]) -> tuple[list[dict], dict]:
    """One burst to each app at the same moment; their rows (each app's own
    processes only), and what the processes both share spent (the client
    included), by role."""
    routed0 = received_by_engine(urls[OURS], pushed_after=time.time())
    before, client0, t0 = cpu_seconds(procs), time.process_time(), time.monotonic()
    records = bursts(urls, model, requests, max_tokens, timeout)
    wall, client = time.monotonic() - t0, time.process_time() - client0
    after = cpu_seconds(procs)
    rows = [row_of(app, records[app], by_role(procs, before, after, app, shared=False), wall, requests, idle[app],
                   _routed(app, url, routed0))
            for app, url in urls.items()]
    shared = {k: v for k, v in by_role(procs, before, after, None).items() if k in SHARED_ROLES}
    shared["client"] = client
    return rows, shared


def _routed(app: str, base_url: str, before: dict[str, int]) -> list[int] | None:
    """Requests per engine since `before` (ours only: stock Ray Serve LLM does not say)."""
    if app != OURS:
        return None
    routed = {e: n - before.get(e, 0) for e, n in received_by_engine(base_url, pushed_after=time.time()).items()}
    return sorted(routed.values(), reverse=True) or None


def row_of(app: str, records: list[dict], cpu: dict[str, float], wall: float, requests: int,
           idle: dict[str, float] | None, routed: list[int] | None) -> dict:
    """A burst's row: throughput and TTFT from the client's token times,
    CPU by role per 1,000 tokens and per message."""
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["tokens"] or 0 for r in ok)
    first = min((r["sent_s"] for r in records), default=0.0)
    last = max((r["arrivals_s"][-1] for r in ok if r["arrivals_s"]), default=first)
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    per_1k = {k: 1000 * v / tokens if tokens else None for k, v in cpu.items()}
    own = sum(cpu[k] for k in OWN_LAYERS[app])
    load = beyond_idle(cpu, idle or {}, wall, tokens)  # the roles in `cpu` only
    sent = sum(messages(r["arrivals_s"]) for r in ok)
    return {"app": app, "requests": requests, "failed": len(records) - len(ok), "tokens": tokens,
            "wall_s": wall, "output_throughput": tokens / (last - first) if last > first else 0.0,
            "median_ttft_ms": 1000 * percentile(ttfts, 0.5) if ttfts else None,
            "p99_ttft_ms": 1000 * percentile(ttfts, 0.99) if ttfts else None,
            "cpu_s": cpu, "cpu_s_per_1k_tokens": per_1k,
            # requests per engine (ours only): an uneven split ends a burst later
            "routed": routed,
            "own_layers": list(OWN_LAYERS[app]),
            "own_cpu_s_per_1k_tokens": 1000 * own / tokens if tokens else None,
            "cpu_s_per_1k_tokens_beyond_idle": load,
            "own_cpu_s_per_1k_tokens_beyond_idle": sum(load[k] for k in OWN_LAYERS[app]) if tokens else None,
            # what a message costs, whatever it carries (MESSAGE_GAP_S)
            "messages": sent, "tokens_per_message": tokens / sent if sent else None,
            "own_cpu_s_per_1k_messages": 1000 * own / sent if sent else None}


def run_bench_serving(out_dir: str, config: str, *, requests: int = 60, max_tokens: int = 512, rounds: int = 3,
                      engines: int | None = None, port: int | None = None, warmup: int = 8,
                      timeout: float = 600.0, ready_timeout: float = 600.0, app_nice: int = 10,
                      app_args: dict | None = None, idle_s: float = 5.0, together: bool = False,
                      progress=None) -> dict:
    out, config_path, port = bench_paths(out_dir, config, port)
    doc = combined_config(config_path, port, requests, engines, app_args)
    our_name = doc["applications"][0]["name"]
    path = out / "app.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rows, shared_cpu = [], []
    with ServedApp(path, out / "serve.log", ready_timeout, app_nice) as served:
        urls = {OURS: served.base_url, STOCK: served.base_url + STOCK_PREFIX}
        if not launcher.wait_until_ready(urls[STOCK], served.model, ready_timeout, served.proc):
            raise RuntimeError(f"{urls[STOCK]} did not answer within {ready_timeout:.0f} s")
        for app, url in urls.items():  # first requests pay one-time costs
            burst(url, served.model, warmup, 32, timeout)
        procs = roles(served.proc.pid, our_name)
        time.sleep(1.0)  # the warm-up's tail settles
        idle, idle_readings, idle_settled = idle_rates(procs, idle_s)
        if not idle_settled:
            print(f"tokenflow bench-serving: warning: the engines still worked after {idle_readings} idle readings; "
                  "the idle rates and the figures beyond them include that work", file=sys.stderr)
        for i in range(rounds):
            if together:
                time.sleep(1.0)
                pair, shared = measure_together(urls, served.model, procs, requests, max_tokens, timeout, idle)
                shared_cpu.append({"round": i, "cpu_s": shared})
            else:
                order = (OURS, STOCK) if i % 2 == 0 else (STOCK, OURS)
                pair = []
                for app in order:
                    time.sleep(1.0)  # the previous burst's tail (pushes, logs) settles
                    pair.append(measure(app, urls[app], served.model, procs, requests, max_tokens, timeout, idle[app]))
            for row in pair:
                row["round"] = i
                rows.append(row)
                if progress is not None:
                    progress(row)
    summary = {"workload": {"config": str(config), "requests": requests, "max_tokens": max_tokens,
                            "rounds": rounds, "engines": engines, "app_nice": app_nice, "warmup": warmup,
                            "idle_s": idle_s, "together": together,
                            "app_args": app_args or {},
                            "method": "both apps in one serve run; "
                                      + ("both apps' bursts at the same moment; each app's processes booked to it, "
                                         "the shared ones (proxy, controller, Ray, client) apart"
                                         if together else "each burst alone on the machine")
                                      + "; per-process CPU time (user+system) read before and after it"},
               "idle_cpu_s_per_s": idle, "idle_readings": idle_readings, "idle_engines_idle": idle_settled,
               "rows": rows, "shared_cpu_s": shared_cpu, "ratios": ratios(rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def ratios(rows: list[dict]) -> dict:
    """TokenFlow over stock, per round, and their medians."""
    per_round = []
    for i in sorted({r["round"] for r in rows}):
        a = next(r for r in rows if r["round"] == i and r["app"] == OURS)
        b = next(r for r in rows if r["round"] == i and r["app"] == STOCK)
        per_round.append({
            "output_throughput": _div(a["output_throughput"], b["output_throughput"]),
            "median_ttft": _div(a["median_ttft_ms"], b["median_ttft_ms"]),
            # Serve's default router can put more of a burst on one engine
            # than it has slots; those requests wait for its answers to end.
            "p99_ttft": _div(a["p99_ttft_ms"], b["p99_ttft_ms"]),
            "own_cpu_per_token": _div(a["own_cpu_s_per_1k_tokens"], b["own_cpu_s_per_1k_tokens"]),
            "own_cpu_per_token_beyond_idle": _div(a["own_cpu_s_per_1k_tokens_beyond_idle"],
                                                  b["own_cpu_s_per_1k_tokens_beyond_idle"]),
            "all_cpu_per_token": _div(sum(a["cpu_s"].values()) / max(a["tokens"], 1),
                                      sum(b["cpu_s"].values()) / max(b["tokens"], 1)),
            "tokens_per_message": _div(a["tokens_per_message"], b["tokens_per_message"]),
            "own_cpu_per_message": _div(a["own_cpu_s_per_1k_messages"], b["own_cpu_s_per_1k_messages"]),
        })
    keys = per_round[0].keys() if per_round else ()
    med = {k: statistics.median([r[k] for r in per_round if r[k] is not None] or [float("nan")]) for k in keys}
    return {"per_round": per_round, "median": med}


def _div(a, b):
    return a / b if a is not None and b else None


def _median_over_rounds(summary: dict, app: str, f) -> float | None:
    """The median of f(row) over `app`'s rounds, leaving out None."""
    xs = [x for x in (f(r) for r in summary["rows"] if r["app"] == app) if x is not None]
    return statistics.median(xs) if xs else None


def table(summary: dict) -> str:
    """A Markdown table of CPU seconds per 1,000 tokens by role, per app (medians over rounds)."""
    lines = ["| role | " + " | ".join((OURS, STOCK)) + " |", "| --- | --- | --- |"]

    med = functools.partial(_median_over_rounds, summary)

    for role in ROLES:
        cells = [med(app, lambda r: r["cpu_s_per_1k_tokens"].get(role)) for app in (OURS, STOCK)]
        lines.append(f"| {role} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    for label, f in (("own layers", lambda r: r["own_cpu_s_per_1k_tokens"]),
                     ("tokens per message", lambda r: r["tokens_per_message"]),
                     ("own layers per 1,000 messages", lambda r: r["own_cpu_s_per_1k_messages"]),
                     ("output tokens/s", lambda r: r["output_throughput"]),
                     ("median TTFT (ms)", lambda r: r["median_ttft_ms"]),
                     ("P99 TTFT (ms)", lambda r: r["p99_ttft_ms"])):
        cells = [med(app, f) for app in (OURS, STOCK)]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def idle_table(summary: dict) -> str:
    """Each role's CPU per second while idle, and per 1,000 tokens beyond it
    (medians over rounds), per app."""
    idle = summary["idle_cpu_s_per_s"]
    lines = ["| role | idle CPU s per s, " + ", ".join((OURS, STOCK)) + " | CPU s per 1,000 tokens beyond idle, "
             + ", ".join((OURS, STOCK)) + " |", "| --- | --- | --- |"]

    med = functools.partial(_median_over_rounds, summary)

    def cells(xs):
        return " / ".join("-" if x is None else f"{x:.3f}" for x in xs)

    for role in ROLES:
        beyond = [med(app, lambda r: r["cpu_s_per_1k_tokens_beyond_idle"].get(role)) for app in (OURS, STOCK)]
        lines.append(f"| {role} | {cells([idle[app][role] for app in (OURS, STOCK)])} | {cells(beyond)} |")
    own_idle = [sum(idle[app][k] for k in OWN_LAYERS[app]) for app in (OURS, STOCK)]
    own_beyond = [med(app, lambda r: r["own_cpu_s_per_1k_tokens_beyond_idle"]) for app in (OURS, STOCK)]
    lines.append(f"| own layers | {cells(own_idle)} | {cells(own_beyond)} |")
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/local.yaml", help="TokenFlow's `serve run` config")
    parser.add_argument("--requests", type=int, default=60, help="streams per burst (all within the slots)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per app, alternating which app goes first")
    parser.add_argument("--engines", type=int, help="engine replicas per app (default: the config's num_replicas)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--app-nice", type=int, default=10, choices=range(0, 20), metavar="0-19",
                        help="the apps' CPU priority below the client's (bench-app's --app-nice)")
    parser.add_argument("--app-args", default="{}",
                        help="JSON deep-merged into TokenFlow's app args, e.g. '{\"router\": {\"enabled\": false}}' "
                             "to see what a feature costs")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="seconds of both apps idle, before the bursts, to read each role's CPU per second "
                             "apart from what it spends per token")
    parser.add_argument("--together", action="store_true",
                        help="send each round's burst to both apps at the same moment (both meet the same "
                             "machine; the shared processes are booked apart)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="out/bench-serving")


def run(args) -> int:
    launcher.stop_on_signals()
    for name in ("requests", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            print(f"tokenflow bench-serving: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.engines is not None and args.engines < 1:
        print("tokenflow bench-serving: error: --engines must be at least 1", file=sys.stderr)
        return 2
    if not args.idle_s > 0:
        print("tokenflow bench-serving: error: --idle-s must be above 0", file=sys.stderr)
        return 2

    if (app_args := launcher.app_args_arg("bench-serving", args.app_args)) is None:
        return 2

    def progress(row: dict) -> None:
        print(json.dumps({k: row[k] for k in ("round", "app", "tokens", "failed", "output_throughput",
                                              "median_ttft_ms", "p99_ttft_ms", "own_cpu_s_per_1k_tokens",
                                              "own_cpu_s_per_1k_tokens_beyond_idle", "routed")}), flush=True)

    try:
        summary = run_bench_serving(args.out, args.config, requests=args.requests, max_tokens=args.max_tokens,
                                    rounds=args.rounds, engines=args.engines, port=args.port,
                                    ready_timeout=args.ready_timeout, app_nice=args.app_nice, app_args=app_args,
                                    idle_s=args.idle_s, together=args.together, progress=progress)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"tokenflow bench-serving: error: {e}", file=sys.stderr)
        return 1
    print(table(summary))
    print(idle_table(summary))
    print(json.dumps(summary["ratios"]["median"]))
    print(f"wrote {args.out}/summary.json")
    return 1 if any(r["failed"] for r in summary["rows"]) else 0
