"""`tokenflow bench-app`: the policies side by side, end to end through the served app.

What users see: HTTP, the ingress, the slack router and every engine of a
`serve run` config. For each policy in turn the bench starts the app from
the config with only `tokenflow.policy` changed, waits until an engine
really answers, drives the same seeded schedule of streaming readers at it
(tokenflow/tools/loadtest/http_reader.py, the Locust users' accounting), and stops it.
Tokens are timed by the client as their SSE lines arrive.

`--together` serves every policy's app at once instead, each at route
prefix /<policy> with its share of the engines, and sends each the same
requests at the same moments: on a small machine whose speed drifts
between runs, the policies then meet the same drift, and the summary pairs
each request's first tokens. Each app has fewer engines than the config's,
and the apps share the machine.

`--load F` first measures what the app decodes (the first policy's app,
every slot of every engine streaming at once; together: every app at once,
their mean) and sizes the workload to F x that, so one command means the
same contention on any machine: a burst's readers together read F x
capacity, and are at least twice the engines' slots (`--readers-per-slot`),
slower where needed, since readers outnumber a GPU's slots. Each result
records the load the run then met (`load_seen`), as the machine's speed
can drift between the calibration and the run.

OUT gets requests-<policy>.jsonl, summary.json (the schema of `tokenflow
bench`, plus SLO goodput and vLLM's benchmark fields under its names),
app-<policy>.yaml and serve-<policy>.log (together: app-together.yaml and
serve-together.log) and the same plots as `tokenflow bench`.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from tokenflow.tools import launcher
from tokenflow.tools.bench import RATIO_KEYS, paired_ttft, percentile, ratios, run_order
from tokenflow.tools.loadtest import http_reader
from tokenflow.tools.loadtest.exporter import ClientMetrics
from tokenflow.tools.loadtest.exporter import add_arguments as add_metrics_arguments
from tokenflow.tools.loadtest.runner import summarize as summarize_client
from tokenflow.tools.loadtest.shapes import MAX_REQUESTS, Schedule, make_schedule, mean_rate, parse_rates

POLICIES = ("fcfs", "andes", "tokenflow")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class AppWorkload:
    shape: str
    requests: int  # per burst for "bursts" when sized by load; else the total
    rates: str  # reading-rate mix, value:weight,...
    max_tokens: int
    prompt: str
    arrival_rate: float | None = None
    cv: float = 2.0
    bursts: int = 1
    period: float | None = None
    seed: int = 0
    load: float | None = None  # share of the measured capacity the readers need
    per_slot: float = 0.0  # a burst sized by load has at least this many readers per engine slot
    rate_scale: float = 1.0  # what at_load multiplied the mix's rates by to keep the load (1: unscaled)

    def schedule(self) -> Schedule:
        return make_schedule(self.shape, self.requests, self.rates, arrival_rate=self.arrival_rate, cv=self.cv,
                             bursts=self.bursts, period=self.period, seed=self.seed)

    def at_load(self, decode_tps: float, slots: int) -> "AppWorkload":
        """A burst (or each of the bursts) of as many readers as together read
        load x capacity; Poisson or gamma arrivals bringing load x capacity
        tokens/s.

        A burst also has at least `per_slot` readers per engine slot. On a
        GPU, readers at 4-40 tokens/s who need a share of its capacity
        outnumber its slots many times over, and under FCFS the later ones
        wait for a slot; a CPU decodes so little that the same rates give a
        burst that fits its slots, where no policy has anything to decide.
        There the readers are more and slower: the mix's rates are scaled
        down so that together they still need load x capacity."""
        if self.shape not in ("burst", "bursts"):
            return replace(self, arrival_rate=self.load * decode_tps / self.max_tokens)
        mix = parse_rates(self.rates)
        need = self.load * decode_tps
        by_rate = max(1, round(need / mean_rate(mix)))
        per_burst = max(by_rate, math.ceil(self.per_slot * slots))
        scale = 1.0 if per_burst == by_rate else need / (per_burst * mean_rate(mix))
        rates = self.rates if scale == 1.0 else ",".join(f"{v * scale:.4g}:{w:g}" for v, w in mix)
        return replace(self, requests=per_burst * (self.bursts if self.shape == "bursts" else 1),
                       rates=rates, rate_scale=scale)


# --- the app under test ---------------------------------------------------------

def app_config(config: Path, policy: str, port: int, requests: int, engines: int | None,
               tokenflow: dict) -> dict:
    """The config with its policy set, the admission bound above any
    workload's size (a bench measures scheduling, not 429s) and the model
    path made absolute."""
    doc = copy.deepcopy(yaml.safe_load(config.read_text()) or {})
    doc.setdefault("http_options", {})["port"] = port
    args = doc["applications"][0].setdefault("args", {})
    args["tokenflow"] = {**(args.get("tokenflow") or {}), **tokenflow, "policy": policy}
    admission = args.get("admission") or {}
    admission["max_ongoing_requests"] = max(int(admission.get("max_ongoing_requests", 0)), requests + 8)
    args["admission"] = admission
    if engines:
        args["num_replicas"] = engines
    model = Path(args.get("model_path", ""))
    if args.get("model_path") and not model.is_absolute():
        args["model_path"] = str(ROOT / model)
    return doc


def share_bundles(entry: dict, share: float) -> None:
    """Scale an app entry's placement-group CPUs by `share`, where more
    engines than the config's must fit on its nodes (logical CPUs only; each
    engine's threads are set by its env)."""
    args = entry["args"]
    for llm in args.get("llm_configs", [args]):
        pg = llm.get("placement_group_config") or {}
        for bundle in pg.get("bundles", []):
            if "CPU" in bundle:
                bundle["CPU"] = bundle["CPU"] * share


def together_config(config: Path, policies: list[str], port: int, requests: int, engines: int | None,
                    tokenflow: dict) -> dict:
    """One `serve run` config with an app per policy, each at route prefix
    /<policy> with its share of the engines (at least one) and of their
    placement CPUs, and the config's app otherwise."""
    from tokenflow.serve import app as tf_app

    doc = app_config(config, policies[0], port, requests, engines, tokenflow)
    if len(doc["applications"]) != 1:
        raise ValueError("bench-app --together needs a config of one application")
    entry = doc["applications"][0]
    entry["args"]["placement_group_config"] = copy.deepcopy(
        tf_app.resolve_args(entry["args"])["placement_group_config"])
    total = int(entry["args"].get("num_replicas", 1))
    per_app = max(1, total // len(policies))
    apps = []
    for policy in policies:
        app = copy.deepcopy(entry)
        app["name"] = f"{entry.get('name', 'tokenflow')}-{policy}"
        app["route_prefix"] = f"/{policy}"
        app["args"]["tokenflow"]["policy"] = policy
        app["args"]["num_replicas"] = per_app
        share_bundles(app, min(1.0, total / (per_app * len(policies))))
        apps.append(app)
    doc["applications"] = apps
    return doc


def slots(doc: dict) -> int:
    """Sequence slots over all engines: the calibration's concurrency."""
    args = doc["applications"][0]["args"]
    per_engine = int((args.get("engine_kwargs") or {}).get("max_num_seqs", 256))
    return int(args.get("num_replicas", 1)) * per_engine


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def autogroup_of(pid: int) -> str | None:
    """The kernel's CPU group of a process and its nice ("/autogroup-90 nice 10"), where it has them."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().strip()
    except OSError:
        return None


class ServedApp:
    """`serve run` of one config, from start to a clean stop (context manager)."""

    def __init__(self, config_path: Path, log_path: Path, ready_timeout: float, niceness: int = 0):
        self.config_path, self.log_path, self.ready_timeout = config_path, log_path, ready_timeout
        self.niceness = niceness
        s = launcher.app_settings(str(config_path))
        self.base_url, self.model = f"http://{s['host']}:{s['port']}", s["model"]
        self.host, self.port = s["host"], s["port"]
        self.first_url = self.base_url + s["route"].rstrip("/")  # the first app: ready means it answers

    def __enter__(self) -> "ServedApp":
        if not port_free(self.host, self.port):
            raise RuntimeError(f"something already listens at {self.base_url}; stop it or pass --port")
        self.shm_before = launcher.shm_names()
        self.log = open(self.log_path, "wb")
        self.proc = launcher.start(str(self.config_path), log=self.log, niceness=self.niceness)
        try:
            ready = launcher.wait_until_ready(self.first_url, self.model, self.ready_timeout, self.proc)
        except BaseException:  # Ctrl-C while it starts: the app goes too
            self.__exit__(None, None, None)
            raise
        if not ready:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the app did not answer within {self.ready_timeout:.0f} s; see {self.log_path}")
        return self

    def __exit__(self, *exc) -> None:
        launcher.stop(self.proc)
        self.log.close()
        launcher.remove_shm_leftovers(self.shm_before, settle=15.0)


# --- driving it -----------------------------------------------------------------

class Progress:
    """A progress bar over the requests of one run (tqdm, on stderr)."""

    def __init__(self, total: int, label: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)
        self.tokens = self.failed = 0

    def __call__(self, record: dict) -> None:
        self.tokens += record.get("tokens") or 0
        self.failed += not record["ok"]
        self.bar.set_postfix(tokens=self.tokens, failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def engines_view(url: str) -> dict:
    """GET /v1/tokenflow/engines: the app's engines, their routing and the
    node KV pools. Raises if the app does not answer."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/tokenflow/engines", timeout=10) as resp:
        return json.loads(resp.read())


def engine_rows(url: str, pushed_after: float | None = None, timeout: float = 5.0) -> list[dict] | None:
    """Each engine's last pushed state; None if the app does not answer.
    With `pushed_after` (a time.time()), waits up to `timeout` for every
    engine to have pushed since then, so the rows count every request that
    reached it before: the view lags the engines by up to a push interval
    (an idle engine re-pushes a few times per stale_after_s). The engines'
    clocks are this host's here (one node)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rows = engines_view(url).get("engines", [])
        except (OSError, ValueError):
            return None
        if pushed_after is None or time.monotonic() > deadline or \
                all((e.get("sent_at") or 0.0) > pushed_after for e in rows):
            return rows
        time.sleep(0.05)


# What a routing record keeps of each engine row of a request router's table.
ROUTING_FIELDS = ("engine_id", "age_s", "slack_s", "pending", "routed", "running", "waiting", "rate_sum",
                  "buffered_capped", "stream_tps", "peak_tps", "received_total")


class RoutingRecorder:
    """`--record-routing S`: while a run drives the apps, GET each one's
    /v1/tokenflow/engines every S seconds and append what its ingress's
    request routers hold (per engine: pending sends, requests routed, slack,
    state age; and the choices made since the last poll, each with the
    best engines' slack and load then) to routing-<app>.jsonl, so that an
    uneven split of a burst carries its own record. Off by default: each poll costs the app a state
    board read and the node pools' stats."""

    def __init__(self, urls: dict[str, str], out: Path, interval: float | None):
        self.urls, self.out, self.interval = urls, out, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RoutingRecorder":
        if self.interval:
            self._thread = threading.Thread(target=self._run, name="routing-recorder", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        t0 = time.monotonic()
        files = {name: open(self.out / f"routing-{name}.jsonl", "w") for name in self.urls}
        last: dict[tuple, float] = {}  # (app, router) -> time of the last choice written
        try:
            while True:
                for name, url in self.urls.items():
                    try:
                        view = engines_view(url)
                    except (OSError, ValueError):
                        continue  # a busy moment: the next poll will do
                    routers = {}
                    for key, r in (view.get("routers") or {}).items():
                        seen = last.get((name, key), float("-inf"))
                        new = [c for c in r.get("choices") or () if c["t"] > seen]
                        if new:
                            last[(name, key)] = new[-1]["t"]
                        routers[key] = {"engines": [{k: e.get(k) for k in ROUTING_FIELDS} for e in r.get("engines", [])],
                                        "fallbacks": r.get("fallbacks"), "choices": new}
                    files[name].write(json.dumps({"t": round(time.monotonic() - t0, 3), "routers": routers}) + "\n")
                if self._stop.wait(self.interval):
                    return
        finally:
            for f in files.values():
                f.close()


def received_by_engine(url: str, pushed_after: float | None = None) -> dict[str, int]:
    """Requests each engine has received since it started (as of a push
    after `pushed_after`, if given); {} if unknown."""
    return {e["engine_id"]: int(e.get("received_total") or 0) for e in engine_rows(url, pushed_after) or []}


def engine_counters(url: str, received_before: dict[str, int], pushed_after: float | None = None) -> dict | None:
    """Each engine's TokenFlow scheduler totals (pauses, resumes, recomputed
    tokens) and `received`: the requests routed to it since
    `received_before` (an uneven split of a burst shows here)."""
    rows = engine_rows(url, pushed_after)
    if rows is None:
        return None
    return {e["engine_id"]: {**((e.get("scheduler") or {}).get("stats") or {}),
                             "received": int(e.get("received_total") or 0) - received_before.get(e["engine_id"], 0)}
            for e in rows}


def drive_apps(urls: dict[str, str], model: str, wl: AppWorkload, timeout: float, metrics=None,
               label: str | None = None) -> dict[str, list[dict]]:
    """One schedule against each app of `urls` (name -> base URL) at once:
    the same requests at the same offsets. Each finished request also goes
    to `metrics` (a ClientMetrics) under its app's name. Records by app."""
    sched = wl.schedule()
    bodies = [http_reader.chat_body(model, f"{wl.prompt} (reader {i})", wl.max_tokens, rate)
              for i, rate in enumerate(sched.rates)]
    progress = Progress(len(sched) * len(urls), label or "+".join(urls))
    key = launcher.api_key_from_env()

    def on_record(name: str):
        def record_one(record: dict) -> None:
            progress(record)
            if metrics is not None:
                metrics.observe(record, model, name)
        return record_one

    async def every_app() -> dict[str, list[dict]]:
        runs = [http_reader.run_schedule(url, bodies, sched.rates, sched.offsets, timeout, on_record(name), key)
                for name, url in urls.items()]
        return dict(zip(urls, await asyncio.gather(*runs)))

    try:
        return asyncio.run(every_app())
    finally:
        progress.close()


def drive(app: ServedApp, wl: AppWorkload, label: str, timeout: float, metrics=None) -> list[dict]:
    """One schedule against the app, its records under the run label `label`."""
    return drive_apps({label: app.first_url}, app.model, wl, timeout, metrics)[label]


def calibrate(urls: dict[str, str], model: str, concurrency: int, tokens: int, prompt: str, timeout: float) -> dict:
    """What an app decodes with every slot busy: `concurrency` streams at
    once to each app of `urls` (all apps at once), readers too fast to
    matter; the mean over the apps."""
    wl = AppWorkload(shape="burst", requests=concurrency, rates="10000", max_tokens=tokens, prompt=prompt)
    per_app = {name: window_rate(records) for name, records in drive_apps(urls, model, wl, timeout,
                                                                          label="calibrating").items()}
    return {"decode_tps": statistics.fmean(x["decode_tps"] for x in per_app.values()), "streams": concurrency,
            "failed": sum(x["failed"] for x in per_app.values()),
            "window_s": min(x["window_s"] for x in per_app.values()),
            **({"per_app": per_app} if len(per_app) > 1 else {}),
            "method": "every engine slot streaming at once through the app; client-side token times"}


def window_rate(records: list[dict]) -> dict:
    """Tokens per second over the window in which every stream of a
    calibration burst streams (after the last first token, before the first
    answer ends)."""
    ok = [r for r in records if r["ok"] and r["arrivals_s"]]
    if not ok:
        raise RuntimeError(f"calibration failed: {records[0]['error'] if records else 'no requests'}")
    start = max(r["arrivals_s"][0] for r in ok)
    end = min(r["arrivals_s"][-1] for r in ok)
    first, last = min(r["arrivals_s"][0] for r in ok), max(r["arrivals_s"][-1] for r in ok)
    if end - start < max(0.5, (last - first) / 4):
        # No common window worth the name (one stream started as the others
        # ended, a slot short on one engine): a fraction of a second of
        # tokens gave twice the real rate once. The whole run instead.
        start, end = first, last
    n = sum(sum(1 for t in r["arrivals_s"] if start <= t <= end) for r in ok)
    return {"decode_tps": n / (end - start) if end > start else 0.0, "failed": len(records) - len(ok),
            "window_s": end - start}


# --- figures --------------------------------------------------------------------

def _ms_stats(xs: list[float], name: str) -> dict:
    """vLLM's benchmark fields for one latency (seconds in, ms out)."""
    if not xs:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p90", "p99")}
    return {f"mean_{name}_ms": statistics.fmean(xs) * 1e3, f"median_{name}_ms": percentile(xs, 0.5) * 1e3,
            f"std_{name}_ms": statistics.pstdev(xs) * 1e3, f"p90_{name}_ms": percentile(xs, 0.9) * 1e3,
            f"p99_{name}_ms": percentile(xs, 0.99) * 1e3}


def effective_lost(records: list[dict]) -> dict:
    """Where effective throughput went: the weight tokens lost by arriving
    past their reader's cap (tokenflow.core.buffer.token_weight), in all,
    by reading rate, and by quarter of the run (first send to last token):
    a policy that lets running readers build buffers while others wait
    loses it mid-run; the run's tail, where fewer readers are left than
    the engines can feed, loses it under any policy."""
    from tokenflow.core.buffer import ReaderBuffer

    ok = [r for r in records if r.get("arrivals_s")]
    if not ok:
        return {"tokens": 0.0, "share": 0.0, "by_rate": {}, "by_quarter": [0.0] * 4}
    start, end = min(r["sent_s"] for r in ok), max(r["arrivals_s"][-1] for r in ok)
    span = (end - start) or 1.0
    by_rate: dict[str, float] = {}
    quarters = [0.0] * 4
    for r in ok:
        reader = ReaderBuffer.replay(r["rate"], r["sent_s"], r["arrivals_s"])
        rate = f"{r['rate']:.4g}"
        for t, w in zip(r["arrivals_s"], reader.weights()):
            by_rate[rate] = by_rate.get(rate, 0.0) + 1.0 - w
            quarters[min(3, int(4 * (t - start) / span))] += 1.0 - w
    lost = sum(quarters)
    return {"tokens": lost, "share": lost / sum(len(r["arrivals_s"]) for r in ok),
            "by_rate": dict(sorted(by_rate.items(), key=lambda kv: float(kv[0]))), "by_quarter": quarters}


def summarize(records: list[dict], max_tokens: int, slo_ttft: float, slo_stall: float) -> dict:
    """`tokenflow bench`'s fields, SLO goodput, and vLLM bench's fields."""
    full = [r for r in records if r["ok"] and r["tokens"] == max_tokens]
    res = summarize_client(records, len(records))
    res["completed"], res["failed"] = len(full), len(records) - len(full)
    wall = res["wall_s"] or float("nan")
    met = [r for r in full if r["ttft_s"] <= slo_ttft and r["stall_s"] <= slo_stall]
    res.update({
        "slo": {"ttft_s": slo_ttft, "stall_s": slo_stall},
        "slo_attainment": len(met) / len(records),  # requests within both limits, of all sent
        "request_goodput": len(met) / wall,  # of those, per second (vLLM's name)
        "duration": wall,
        "total_input_tokens": sum(r.get("prompt_tokens") or 0 for r in records),
        "total_output_tokens": res["tokens"],
        "request_throughput": len(full) / wall,
        "output_throughput": res["tokens"] / wall,
    })
    res["total_token_throughput"] = (res["total_input_tokens"] + res["tokens"]) / wall
    # How late the client sent against the schedule: its own health. On a
    # machine where the app takes every core, the client's event loop lags,
    # and every time it takes (sends, first tokens) lags with it.
    res["client_send_lag_p99_s"] = percentile([r["sent_s"] - r["scheduled_s"] for r in records], 0.99)
    res.update(_ms_stats([r["ttft_s"] for r in full], "ttft"))
    res.update(_ms_stats([(r["total_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in full if r["tokens"] > 1], "tpot"))
    res.update(_ms_stats([x for r in full for x in r["tbt_s"]], "itl"))
    res.update(_ms_stats([r["total_s"] for r in full], "e2el"))
    res["effective_lost"] = effective_lost(records)
    res["stall_by_rate"] = stall_by_rate(records)
    return res


def stall_by_rate(records: list[dict]) -> dict:
    """Each reading rate's stalls: a policy that shares slots among more
    readers than fit can leave the fastest readers, whose rate is near what
    one stream decodes, short, where the mean stall hides them."""
    by_rate: dict[str, list[float]] = {}
    for r in records:
        if r["ok"]:
            by_rate.setdefault(f"{r['rate']:.4g}", []).append(r["stall_s"])
    return {rate: {"requests": len(xs), "stall_s_mean": statistics.fmean(xs), "stall_s_max": max(xs)}
            for rate, xs in sorted(by_rate.items(), key=lambda kv: float(kv[0]))}


def load_seen(records: list[dict], slots: int) -> dict:
    """The load the run met, beside the one the calibration set: the
    readers' need (their rates summed) over what the app decoded while at
    least `slots` streams were mid-answer (first token in, last not yet),
    i.e. with every engine slot streaming, as in the calibration. The
    machine's speed can drift between the calibration and the run; on a
    2-core VM it moved by a third. None when the slots were never all busy."""
    live = [r["arrivals_s"] for r in records if r.get("arrivals_s")]
    edges = sorted([(a[0], 1) for a in live] + [(a[-1], -1) for a in live])
    busy, n = [], 0
    for (t, step), (t_next, _) in zip(edges, edges[1:]):
        n += step
        if n >= slots and t_next > t:
            busy.append((t, t_next))
    starts = [a for a, _ in busy]
    tokens = 0
    for arrivals in live:
        for t in arrivals:
            i = bisect.bisect_right(starts, t) - 1
            tokens += i >= 0 and t < busy[i][1]
    if not tokens:
        return {"busy_s": 0.0, "busy_tps": None, "need_tps": None, "load": None}
    span = sum(b - a for a, b in busy)
    need, busy_tps = sum(r["rate"] for r in records), tokens / span
    return {"busy_s": span, "busy_tps": busy_tps, "need_tps": need, "load": need / busy_tps}


def plot_records(records: list[dict]) -> list[dict]:
    """The fields `tokenflow bench`'s plots read."""
    return [{"id": r["id"], "rate": r["rate"], "arrival_s": r["sent_s"], "ttft_s": r["ttft_s"],
             "arrivals_s": r["arrivals_s"]} for r in records if r["arrivals_s"]]


# --- the whole run ----------------------------------------------------------------

def bench_paths(out_dir: str, config: str, port: int | None) -> tuple[Path, Path, int]:
    """The output folder (made), the config (checked) and the app's port."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_path = Path(config)
    if not config_path.is_file():
        raise FileNotFoundError(f"no such config: {config}")
    return out, config_path, port or launcher.app_settings(config)["port"]


def run_bench_app(out_dir: str, config: str, wl: AppWorkload, policies=POLICIES, *, port: int | None = None,
                  engines: int | None = None, tokenflow: dict | None = None, slo_ttft: float = 2.0,
                  slo_stall: float = 1.0, timeout: float = 600.0, ready_timeout: float = 600.0,
                  calibration_tokens: int = 256, plots: bool = True, app_nice: int = 0,
                  metrics_port: int | None = None, together: bool = False,
                  record_routing: float | None = None) -> dict:
    out, config_path, port = bench_paths(out_dir, config, port)
    metrics = ClientMetrics(metrics_port) if metrics_port is not None else None
    order = run_order(policies, wl.seed)
    run = run_together if together else run_in_turn
    records, counters, served, calibration, wl = run(out, config_path, wl, order, port, engines, tokenflow or {},
                                                     timeout, ready_timeout, calibration_tokens, app_nice, metrics,
                                                     record_routing)
    results = {}
    for policy in order:
        results[policy] = summarize(records[policy], wl.max_tokens, slo_ttft, slo_stall)
        results[policy]["load_seen"] = load_seen(records[policy], served[policy]["slots"])
        # Totals since the app started, the calibration's steps included;
        # `received`: this run's requests only.
        results[policy]["scheduler_stats"] = counters[policy]
        with open(out / f"requests-{policy}.jsonl", "w") as f:
            for rec in records[policy]:
                f.write(json.dumps(rec) + "\n")
        print(json.dumps({"policy": policy, **{k: v for k, v in results[policy].items() if not k.startswith(
            ("mean_", "median_", "std_", "p90_"))}}), flush=True)
    summary = {
        "workload": {**wl.__dict__, "requests": wl.requests, "config": str(config), "engines": engines,
                     "app_nice": app_nice, "together": together,
                     "timing": "client-side: token times taken by the bench's HTTP client as SSE lines arrive "
                               "from the served app (ingress, router, engines)"
                               + ("; together: every policy's app served at once, each sent the same requests "
                                  "at the same moments" if together else ""),
                     "calibration": calibration, "apps": served, "order": order},
        "results": results,
        "ratios_tokenflow_vs_fcfs": ratios(results, {**RATIO_KEYS, "request_goodput": "request_goodput"}),
    }
    if together:
        ttfts = {p: {r["id"]: r["ttft_s"] for r in recs if r["ok"]} for p, recs in records.items()}
        if (paired := paired_ttft(ttfts)) is not None:
            summary["paired_ttft_tokenflow_minus_fcfs"] = paired
    if metrics is not None:
        metrics.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if plots:
        from tokenflow.tools.bench_plots import write_plots

        write_plots(out, {p: plot_records(r) for p, r in records.items()}, wl)
    return summary


def run_in_turn(out: Path, config_path: Path, wl: AppWorkload, order: list[str], port: int, engines: int | None,
                tokenflow: dict, timeout: float, ready_timeout: float, calibration_tokens: int, app_nice: int,
                metrics, record_routing: float | None = None) -> tuple:
    """Each policy's app on its own, one after another, every engine each."""
    records, counters, served, calibration = {}, {}, {}, None
    for policy in order:
        doc = app_config(config_path, policy, port, MAX_REQUESTS, engines, tokenflow)
        path = out / f"app-{policy}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        with ServedApp(path, out / f"serve-{policy}.log", ready_timeout, app_nice) as app:
            app_slots = slots(doc)
            if wl.load and calibration is None:
                calibration = calibrate({policy: app.first_url}, app.model, app_slots, calibration_tokens,
                                        wl.prompt, timeout)
                calibration.update(load=wl.load, measured_with=policy)
                wl = wl.at_load(calibration["decode_tps"], app_slots)
                print_calibration(calibration, wl)
            # The readiness probe and the calibration are not this run's.
            received0 = received_by_engine(app.first_url, pushed_after=time.time())
            t0 = time.monotonic()
            with RoutingRecorder({policy: app.first_url}, out, record_routing):
                records[policy] = drive(app, wl, policy, timeout, metrics)
            served[policy] = {"config": path.name, "run_s": time.monotonic() - t0, "slots": app_slots,
                              **priority_of(app)}
            counters[policy] = engine_counters(app.first_url, received0, pushed_after=time.time())
    return records, counters, served, calibration, wl


def run_together(out: Path, config_path: Path, wl: AppWorkload, order: list[str], port: int, engines: int | None,
                 tokenflow: dict, timeout: float, ready_timeout: float, calibration_tokens: int, app_nice: int,
                 metrics, record_routing: float | None = None) -> tuple:
    """Every policy's app at once in one `serve run`, each with its share of
    the engines; each sent the same requests at the same moments, so that
    the machine's drift over the run meets every policy alike."""
    doc = together_config(config_path, order, port, MAX_REQUESTS, engines, tokenflow)
    path = out / "app-together.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    calibration = None
    with ServedApp(path, out / "serve-together.log", ready_timeout, app_nice) as app:
        urls = {policy: f"{app.base_url}/{policy}" for policy in order}
        for url in urls.values():
            if not launcher.wait_until_ready(url, app.model, ready_timeout, app.proc):
                raise RuntimeError(f"{url} did not answer within {ready_timeout:.0f} s; see {app.log_path}")
        app_slots = slots({"applications": doc["applications"][:1]})  # each app's
        if wl.load:
            calibration = calibrate(urls, app.model, app_slots, calibration_tokens, wl.prompt, timeout)
            calibration.update(load=wl.load, measured_with="together")
            wl = wl.at_load(calibration["decode_tps"], app_slots)
            print_calibration(calibration, wl)
        now = time.time()
        t0, received0 = time.monotonic(), {p: received_by_engine(url, pushed_after=now) for p, url in urls.items()}
        with RoutingRecorder(urls, out, record_routing):
            records = drive_apps(urls, app.model, wl, timeout, metrics)
        run_s = time.monotonic() - t0
        served = {p: {"config": path.name, "run_s": run_s, "slots": app_slots, **priority_of(app)} for p in order}
        now = time.time()
        counters = {p: engine_counters(url, received0[p], pushed_after=now) for p, url in urls.items()}
    return records, counters, served, calibration, wl


def print_calibration(calibration: dict, wl: AppWorkload) -> None:
    print(json.dumps({"calibration": calibration, "requests": wl.requests, "rates": wl.rates,
                      "arrival_rate": wl.arrival_rate}), flush=True)


def priority_of(app: ServedApp) -> dict:
    """The running app's CPU priority as the OS reports it, relative to ours."""
    return {"niceness": os.getpriority(os.PRIO_PROCESS, app.proc.pid) - os.nice(0),
            "autogroup": autogroup_of(app.proc.pid)}


# --- command line -------------------------------------------------------------------

def add_arguments(parser) -> None:
    from tokenflow.tools.loadtest.shapes import _positive_float, add_workload_arguments

    parser.add_argument("--config", default="configs/local.yaml",
                        help="the `serve run` config to start for each policy (default: two engines here)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    add_workload_arguments(parser)
    parser.add_argument("--load", type=float, default=1.4,
                        help="size the workload to this share of the app's decode capacity, measured first "
                             "(burst: readers who together read LOAD x capacity; bursts: that many per "
                             "burst; poisson/gamma: arrivals bringing LOAD x capacity tokens/s); "
                             "0: take --requests and --arrival-rate as given")
    parser.add_argument("--readers-per-slot", type=float, default=2.0,
                        help="a burst sized by --load has at least this many readers per engine slot, their "
                             "rates scaled down to keep the load, so that under FCFS some wait for a slot as "
                             "they do on a GPU (default: 2; 0: as many as the rates give)")
    parser.add_argument("--slo-ttft", type=_positive_float, default=2.0,
                        help="SLO goodput: a request meets its SLO with at most this TTFT (s) ...")
    parser.add_argument("--slo-stall", type=_positive_float, default=1.0,
                        help="... and at most this much total stall while its reader reads (s)")
    parser.add_argument("--engines", type=int, help="engine replicas (default: the config's num_replicas)")
    parser.add_argument("--together", action="store_true",
                        help="serve every policy's app at once, each with its share of the engines (at least "
                             "one), and send each the same requests at the same moments, so that the machine's "
                             "drift meets all alike (default: one app after another, each with every engine)")
    parser.add_argument("--port", type=int, help="HTTP port of the app under test (default: the config's)")
    parser.add_argument("--tokenflow", default="{}", help="JSON merged into the config's tokenflow block")
    parser.add_argument("--calibration-tokens", type=int, default=256)
    parser.add_argument("--ready-timeout", type=_positive_float, default=600.0,
                        help="seconds each app may take to answer its first completion")
    parser.add_argument("--app-nice", type=int, default=10, choices=range(0, 20), metavar="0-19",
                        help="run the app under test this much below the client's CPU priority, so that on "
                             "a machine without cores of its own for the client, the client does not starve "
                             "(0: equal)")
    add_metrics_arguments(parser, run_label=False)  # the run label is the policy
    parser.add_argument("--out", default="out/bench-app")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--record-routing", type=_positive_float, metavar="SECONDS",
                        help="poll each app's request routers this often while it runs and write what they hold "
                             "to routing-<policy>.jsonl (off by default: the polls cost the app a little)")
    # A bench's answers are long and may queue behind a whole burst.
    parser.set_defaults(model=None, max_tokens=512, request_timeout=600.0)


def run(args) -> int:
    launcher.stop_on_signals()  # the app under test stops with us
    if args.load < 0:
        raise ValueError(f"--load must be >= 0, got {args.load}")
    if args.readers_per_slot < 0:
        raise ValueError(f"--readers-per-slot must be >= 0, got {args.readers_per_slot}")
    if args.engines is not None and args.engines < 1:
        raise ValueError(f"--engines must be at least 1, got {args.engines}")
    if args.model is not None:
        raise ValueError("bench-app sends the config's model_id; change the config, not --model")
    if args.together and len(set(args.policies)) < 2:
        raise ValueError("--together compares policies: name two or more with --policies")
    tokenflow = json.loads(args.tokenflow)
    if not isinstance(tokenflow, dict) or "policy" in tokenflow:
        raise ValueError("--tokenflow must be a JSON object of tokenflow knobs other than policy")
    wl = AppWorkload(shape=args.shape, requests=args.requests, rates=args.rates, max_tokens=args.max_tokens,
                     prompt=args.prompt, arrival_rate=args.arrival_rate, cv=args.cv, bursts=args.bursts,
                     period=args.period, seed=args.seed, load=args.load or None,
                     per_slot=args.readers_per_slot)
    if wl.load and wl.shape in ("poisson", "gamma"):
        wl = replace(wl, arrival_rate=wl.arrival_rate or 1.0)  # replaced by the calibration
    wl.schedule()  # every workload error before any app starts
    try:
        summary = run_bench_app(args.out, args.config, wl, args.policies, port=args.port, engines=args.engines,
                                tokenflow=tokenflow, slo_ttft=args.slo_ttft, slo_stall=args.slo_stall,
                                timeout=args.request_timeout, ready_timeout=args.ready_timeout,
                                calibration_tokens=args.calibration_tokens, plots=not args.no_plots,
                                app_nice=args.app_nice, metrics_port=args.metrics_port, together=args.together,
                                record_routing=args.record_routing)
    except RuntimeError as e:
        print(f"tokenflow bench-app: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary["ratios_tokenflow_vs_fcfs"]))
    print(f"wrote {args.out}/summary.json")
    failed = sum(r["failed"] for r in summary["results"].values())
    return 1 if failed else 0
