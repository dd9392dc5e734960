"""Metrics and dashboards: the definitions, the dashboards as code, and a real
Prometheus scraping the running app (Ray's service discovery file) while a
burst of streaming readers runs; every dashboard panel must have data, and
the exported counts must match what the client saw."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from tests.engines import ROOT
from tokenflow.core.buffer import ReaderBuffer
from tokenflow.core.sched_state import SchedulerState, SchedulerStats
from tokenflow.serve import metrics as tfm
from tokenflow.serve.streams import EngineTracker, tracked
from tokenflow.tools.loadtest.exporter import CLIENT_METRICS, ClientMetrics

PROMETHEUS = "/usr/bin/prometheus"
RAY_TEMP = Path("/tmp/ray")
RATE_INTERVAL = "1m"  # what the test puts for Grafana's $__rate_interval


def _generator():
    spec = importlib.util.spec_from_file_location("dash_generate", ROOT / "dashboards" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}


def _targets(dash: dict):
    for panel in dash["panels"]:
        for t in panel["targets"]:
            yield panel["title"], t["expr"]


# --- definitions and dashboards, no engine ------------------------------------

def test_dashboards_are_generated_and_checked_in():
    gen = _generator()
    assert gen.stale() == [], "run: python dashboards/generate.py"
    assert set(_dashboards()) == {"tokenflow-overview", "tokenflow-scheduler", "tokenflow-kv", "tokenflow-engine"}
    for dash in _dashboards().values():
        names = [v["name"] for v in dash["templating"]["list"]]
        assert names[:2] == ["datasource", "model"]
        assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    engine = _dashboards()["tokenflow-engine"]
    assert "engine" in [v["name"] for v in engine["templating"]["list"]]
    assert all('=~"$engine"' in e for _, e in _targets(engine))


def test_panels_query_only_defined_metrics():
    known = set()
    for s in tfm.SPECS:
        known |= {s.exported(p) for p in ("bucket", "sum", "count")} if s.kind == "histogram" else {s.exported()}
    used = set()
    for dash in _dashboards().values():
        for _, expr in _targets(dash):
            for name in re.findall(r"\b(ray_[a-z0-9_]+)", expr):
                assert name in known or name.startswith("ray_vllm_"), f"unknown metric {name} in {expr}"
                used.add(name)
    # Every metric is on some dashboard, the client's too.
    for s in tfm.SPECS:
        assert any(n.startswith(tfm.PREFIX + s.name) for n in used), s.name
    client = {name for name, _, _ in CLIENT_METRICS}
    used_client = {n for dash in _dashboards().values() for _, expr in _targets(dash)
                   for n in re.findall(r"\b(tokenflow_client_[a-z0-9_]+)", expr)}
    assert {n.removesuffix("_bucket").removesuffix("_sum") for n in used_client} <= client
    assert client == {n.removesuffix("_bucket").removesuffix("_sum") for n in used_client}


def test_readme_lists_every_metric():
    readme = (ROOT / "README.md").read_text()
    assert tfm.markdown_table() in readme
    assert all(f"`{name}`" in readme for name, _, _ in CLIENT_METRICS)


def test_cumulative_deltas():
    d = tfm.CumulativeDeltas()
    assert d.delta("a", 5) == 5 and d.delta("a", 5) == 0 and d.delta("a", 9) == 4
    assert d.delta("a", 2) == 2  # the source restarted
    assert d.delta("b", None) == 0 and d.delta("b", float("nan")) == 0 and d.delta("b", 1) == 1


class _FakeSet:
    def __init__(self):
        self.calls = []

    def inc(self, name, value, **tags):
        if value > 0:
            self.calls.append(("inc", name, value, tags))

    def set(self, name, value, **tags):
        if value is not None:
            self.calls.append(("set", name, value, tags))

    def observe(self, name, value, **tags):
        self.calls.append(("observe", name, value, tags))

    def of(self, op, name, **tags):
        return [c[2] for c in self.calls if c[:2] == (op, name) and all(c[3].get(k) == v for k, v in tags.items())]


def _fake_engine_metrics():
    em = tfm.EngineMetrics.__new__(tfm.EngineMetrics)
    em.m, em.deltas = _FakeSet(), tfm.CumulativeDeltas()
    return em


def test_scheduler_totals_become_counter_increments_and_gauges():
    em = _fake_engine_metrics()
    # As it arrives from the EngineCore utility: a dict, rebuilt typed.
    wire = {"policy": "tokenflow", "running": 3, "waiting": 1, "paused_hold": 2, "paused_release": 0,
            "buffer_s_min": 0.5, "buffer_s_sum": 4.0, "buffer_s": [0.5, 1.5, 2.0], "required_rate": 60.0, "step_rate": 20.0,
            "peak_step_rate": 30.0,
            "decode_tps": 900.0, "kv_total_blocks": 100, "kv_free_blocks": 40, "host_pool_blocks": 64,
            "stats": asdict(SchedulerStats(pauses_hold=4, pauses_release=1, pauses_skipped=2, resumes=3,
                                           tokens_recomputed=16)),
            "offload": {"blocks_stored": 10, "blocks_loaded": 2, "bytes_stored": 1000, "bytes_loaded": 200,
                        "evictions": 3, "lookup_hits": 1, "lookup_misses": 0, "capacity_blocks": 64}}
    em.sample_scheduler(SchedulerState.from_wire(wire))
    later = json.loads(json.dumps(wire))  # through a serializer, as over vLLM's channel
    later["stats"]["pauses_hold"] = 6
    later["offload"]["blocks_loaded"] = 5
    em.sample_scheduler(SchedulerState.from_wire(later))
    em.sample_scheduler(SchedulerState.from_wire(later))  # nothing new: no increments
    m = em.m
    assert m.of("inc", "tokenflow_pauses", kind="hold") == [4, 2]
    assert m.of("inc", "tokenflow_pauses", kind="release") == [1]
    assert m.of("inc", "tokenflow_pauses_skipped") == [2]
    assert m.of("inc", "tokenflow_tokens_recomputed") == [16]
    assert m.of("inc", "tokenflow_fallbacks") == []
    assert m.of("inc", "tokenflow_kv_offload_blocks", direction="loaded") == [2, 3]
    assert m.of("set", "tokenflow_scheduler_requests", state="paused_hold")[-1] == 2
    assert m.of("set", "tokenflow_kv_pool_blocks", tier="device", kind="used")[-1] == 60
    assert m.of("set", "tokenflow_kv_pool_blocks", tier="host", kind="used")[-1] == 7
    assert m.of("set", "tokenflow_kv_pool_blocks", tier="host", kind="capacity")[-1] == 64
    before = len(m.calls)
    assert SchedulerState.from_wire({}) is None  # another scheduler answers {}
    em.sample_scheduler(None)  # nothing to export
    assert len(m.calls) == before


def test_tracker_feeds_metrics_per_request():
    clock = [0.0]
    em = _fake_engine_metrics()
    tr = EngineTracker(clock=lambda: clock[0], sink=em)

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    async def source():
        clock[0] = 0.3  # first token 0.3 s after arrival
        yield [sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
        for i in range(9):  # 2 tokens per chunk, every 0.1 s
            yield [sse({"choices": [{"index": 0, "delta": {"content": "ab"}}], "usage": {"completion_tokens": 2 * i + 2}})]
            clock[0] += 0.1

    async def run():
        async for _ in tracked(source(), tr, rate=5.0, stream=True, arrival=0.0):
            pass

    asyncio.run(run())
    m = em.m
    assert m.of("observe", "tokenflow_ttft_seconds") == [pytest.approx(0.3)]
    assert m.of("observe", "tokenflow_chunk_gap_seconds") == [pytest.approx(0.1)] * 8
    # Tokens sent are counted by the tracker and exported with each sample.
    assert m.of("inc", "tokenflow_generated_tokens") == []
    em.sample_streams([], {}, tr.tokens_total)
    em.sample_streams([], {}, tr.tokens_total)  # nothing new: no increase
    assert m.of("inc", "tokenflow_generated_tokens") == [18]
    assert m.of("inc", "tokenflow_requests_finished", stream="true", status="ok") == [1]
    ref = ReaderBuffer(rate=5.0, arrival_time=0.0)
    for i in range(9):
        ref.on_tokens(0.3 + 0.1 * i, 2)
    assert m.of("inc", "tokenflow_effective_tokens") == [pytest.approx(ref.effective_tokens(18))]
    # A 5 tok/s reader of 18 tokens sent in 0.8 s never stalls.
    assert m.of("observe", "tokenflow_request_stall_seconds") == [0.0]

    async def broken():
        yield [sse({"choices": [{"index": 0, "delta": {"content": "a"}}]})]
        raise RuntimeError("engine died")

    async def run_broken():
        async for _ in tracked(broken(), tr, rate=5.0, stream=True, arrival=clock[0]):
            pass

    with pytest.raises(RuntimeError):
        asyncio.run(run_broken())
    assert m.of("inc", "tokenflow_requests_finished", stream="true", status="error") == [1]
    assert tr.state()["running"] == 0


def test_a_failing_sink_never_breaks_a_stream():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("sink down")

    tr = EngineTracker(sink=Broken())
    h = tr.open(10.0, True, 0.0)
    tr.add_tokens(h, 3, 0.1)
    tr.close(h, 0.2)
    assert tr.tokens_total == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_to_unreachable_grafana_fails_clearly():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there now
    p = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "dashboards", "push", "--url", url,
                        "--token", "t", "--timeout", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"cannot reach Grafana at {url}" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "dashboards", "push"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs --url" in p.stderr


# --- a real Prometheus against the running app --------------------------------

class Prometheus:
    """A Prometheus server on loopback, scraping Ray's service discovery file."""

    def __init__(self, workdir: Path, sd_file: Path, client_port: int, interval_s: int = 1):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Jobs as in configs/prometheus.yml: Ray's nodes, and the load-test client.
        config = {"global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
                  "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(sd_file)]}]},
                                     {"job_name": "tokenflow-client",
                                      "static_configs": [{"targets": [f"127.0.0.1:{client_port}"]}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def value(self, expr: str) -> float:
        """An instant query's single value; 0 when no series exists (yet)."""
        res = self.api("query", query=expr)["result"]
        return float(res[0]["value"][1]) if res else 0.0

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited; see its log"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("prometheus not ready")


def _app_session_dir() -> Path:
    """The Ray session of the app the `serve_app` fixture started.

    Ray names a session after the process that started the cluster, here
    the fixture's `serve run` (a child of this process). session_latest is
    not enough: another Ray cluster on the machine may have started later."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"run" in cmd and any(c.endswith(b"/serve") for c in cmd):
            sessions = sorted(RAY_TEMP.glob(f"session_*_{entry.name}"))
            if sessions:
                return sessions[-1]
    return RAY_TEMP / "session_latest"


def _sd_file(timeout: float = 60) -> Path:
    # Ray writes it into its session directory (and links the newest one
    # from /tmp/ray/prom_metrics_service_discovery.json).
    path = _app_session_dir() / "prom_metrics_service_discovery.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"Ray wrote no Prometheus service discovery file ({path})"
        time.sleep(1)
    return path


def _stream(client, model: str, rate: float, prompt: str, max_tokens: int) -> dict:
    sent = time.monotonic()
    reader = ReaderBuffer(rate=rate, arrival_time=sent)
    counted = 0
    stream = client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": prompt}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"consumption_rate": rate})
    for chunk in stream:
        now = time.monotonic()
        n = 1 if chunk.choices and chunk.choices[0].delta.content else 0
        if chunk.usage is not None and chunk.usage.completion_tokens > counted + n:
            n = chunk.usage.completion_tokens - counted  # the same rule as the replica's
        if n:
            reader.on_tokens(now, n)
            counted += n
    reader.on_finish(time.monotonic())
    return {"ok": True, "tokens": counted, "effective": reader.effective_tokens(counted), "rate": rate,
            "ttft_s": reader.ttft, "stall_s": reader.stall_time(time.monotonic()),
            "effective_tokens": reader.effective_tokens(counted)}


def _burst(client, model: str, n: int, max_tokens: int, rates: list[float], metrics=None) -> list[dict]:
    """n streaming readers at once (threads), as many rates as given, cycled;
    each result also goes to the client's exporter `metrics`."""
    results, errors = [None] * n, []

    def one(i):
        try:
            results[i] = _stream(client, model, rates[i % len(rates)], f"Tell story {i} about rivers", max_tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for r in results:
        if metrics is not None:
            metrics.observe(r, model, "test")
    return results


def _substitute(expr: str, model: str, engine: str) -> str:
    # As Grafana would with one model and one engine selected (both plain
    # names: letters, digits, dashes, so no regex escaping is needed).
    assert re.fullmatch(r"[\w.-]+", model) and re.fullmatch(r"[\w.-]+", engine), (model, engine)
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", model).replace("$engine", engine)


@pytest.mark.slow
def test_prometheus_sees_the_burst_and_every_panel_has_data(serve_app, client, tmp_path):
    if not Path(PROMETHEUS).is_file():
        pytest.fail(f"{PROMETHEUS} missing: `make test` installs it (apt-get install prometheus)")
    model = serve_app["model"]
    replicas = yaml.safe_load((ROOT / "configs/local.yaml").read_text())["applications"][0]["args"]["num_replicas"]
    client_metrics = ClientMetrics(port=_free_port())  # what the readers saw, exported as bench-app does
    prom = Prometheus(tmp_path, _sd_file(), client_metrics.server.server_port)
    sent_tokens = sent_requests = 0
    try:
        prom.wait_ready()
        sel = f'model_name="{model}"'  # vLLM's own label names
        totals = {
            "ttft": f"sum({tfm.exported('tokenflow_ttft_seconds', 'count')}{{{sel}}})",
            "finished": f'sum({tfm.exported("tokenflow_requests_finished")}{{{sel}, stream="true", status="ok"}})',
            "tokens": f"sum({tfm.exported('tokenflow_generated_tokens')}{{{sel}}})",
            "effective": f"sum({tfm.exported('tokenflow_effective_tokens')}{{{sel}}})",
        }

        def read():
            return {k: prom.value(q) for k, q in totals.items()}

        # Warm-up: a histogram's series appears with its first observation,
        # and rate() cannot see an increase from a series that did not exist,
        # so the quantile panels need series that exist before the burst.
        histograms = [s.exported("count") for s in tfm.engine_specs() if s.kind == "histogram"]
        n, max_tokens, rates = 8, 192, [2.0, 3.0, 4.0, 5.0]
        with urllib.request.urlopen(serve_app["base_url"] + "/v1/tokenflow/engines", timeout=30) as r:
            # fresh: the state board lists a dead replica for a while after.
            live = {e["engine_id"] for e in json.loads(r.read())["engines"] if e["fresh"]}
        # Buffers are sampled once a second (tokenflow/serve/metrics.py): the
        # streams last longer than that, or a short burst can end between two
        # samples of an engine and leave it without a series (or, in the
        # burst below, its buffer panels without data: 48 tokens did once).
        warm_tokens = max_tokens
        for _ in range(3):
            sent_tokens += sum(r["tokens"] for r in _burst(client, model, n, warm_tokens, rates, client_metrics))
            sent_requests += n
            deadline = time.monotonic() + 40  # replicas export every 10 s
            while time.monotonic() < deadline:
                # ... on every live engine (the drill-down shows one).
                missing = [h for h in histograms
                           if not live <= {x["ReplicaId"] for x in prom.api("series", **{"match[]": f"{h}{{{sel}}}"})}]
                if not missing:
                    break
                time.sleep(2)
            if not missing:
                break
        assert not missing, f"no series after warm-up traffic: {missing}"

        # Baseline: every replica scraped, and no older traffic still on its
        # way (replicas export every 10 s): the totals hold still for 12 s.
        deadline = time.monotonic() + 180
        last, since = None, time.monotonic()
        while True:
            up = prom.api("query", query='up{job="ray"}')["result"]
            now_vals = read()
            if now_vals != last or not up or any(r["value"][1] != "1" for r in up):
                last, since = now_vals, time.monotonic()
            elif time.monotonic() - since >= 12:
                break
            assert time.monotonic() < deadline, f"totals never settled: {now_vals}, up={up}"
            time.sleep(1)
        base = last
        ttft_by_engine = f'sum by (ReplicaId) ({tfm.exported("tokenflow_ttft_seconds", "count")}{{{sel}}})'
        base_by_engine = {r["metric"]["ReplicaId"]: float(r["value"][1])
                          for r in prom.api("query", query=ttft_by_engine)["result"]}

        # The burst: 8 streaming readers at once, 192 tokens each. Slow readers
        # (2-5 tokens/s): big buffers, so the scheduler has reason to pause.
        start = time.time()
        results = _burst(client, model, n, max_tokens, rates, client_metrics)
        client_tokens = sum(r["tokens"] for r in results)
        sent_tokens += client_tokens
        sent_requests += n
        client_effective = sum(r["effective"] for r in results)
        assert client_tokens == n * max_tokens

        want = {"ttft": base["ttft"] + n, "finished": base["finished"] + n, "tokens": base["tokens"] + client_tokens}
        deadline = time.monotonic() + 90
        while True:
            got = read()
            if all(got[k] >= want[k] for k in want) or time.monotonic() > deadline:
                break
            time.sleep(1)
        time.sleep(3)  # anything beyond the expected would show up now
        got = read()
        # Exact: one TTFT per stream, one finished stream each, every token.
        assert {k: got[k] for k in want} == want, (got, base)
        # Effective tokens: the replica weighs each token by the buffer its
        # model of the reader has when the token is sent, the client by the
        # buffer when it arrives (through the ingress and the HTTP proxy, on
        # two busy cores). Both count the same tokens (exact usage on every
        # chunk) and start the reader at their own first token, so they
        # differ only by transport jitter J relative to the first token: it
        # moves a buffer by at most rate * J tokens, and the weight falls from
        # 1 to 0 over a ramp of 0.1 * n = 19.2 tokens (buffers of 19.2 to 38.4
        # tokens). Tokens are sent far faster than read, so each request
        # crosses the ramp about once: about 19.2 + 2 * rate * J tokens can
        # differ, each by at most rate * J / 19.2. For rate <= 5 tokens/s and
        # J <= 0.5 s that is at most ~3 tokens of 192; 10% of the tokens
        # leaves room for a jitter several times that.
        server_effective = got["effective"] - base["effective"]
        print(f"effective tokens: server {server_effective:.2f}, client {client_effective:.2f}, "
              f"raw {client_tokens}")
        assert 0 < server_effective <= client_tokens
        assert server_effective == pytest.approx(client_effective, abs=0.1 * client_tokens)

        # Every replica is scraped and tagged, and they are the engines of
        # the app the client talked to (its ingress lists them). A replica
        # that died earlier in the session (tests/test_failover.py kills one)
        # may still be exported with its last values: it served none of this.
        engines = prom.api("label/ReplicaId/values", **{"match[]": f'{tfm.exported("tokenflow_ttft_seconds", "count")}{{{sel}}}'})
        with urllib.request.urlopen(serve_app["base_url"] + "/v1/tokenflow/engines", timeout=30) as r:
            served = sorted(e["engine_id"] for e in json.loads(r.read())["engines"] if e["fresh"])
        after = {r["metric"]["ReplicaId"]: float(r["value"][1]) for r in prom.api("query", query=ttft_by_engine)["result"]}
        assert len(served) == replicas and set(served) <= set(engines), (engines, served)
        # TokenFlow's series join vLLM's own as they are: same label names.
        # vLLM sets its gauges only while its engine steps, and Ray's agent
        # drops a gauge not set again since the last scrape, so an engine
        # idle since the warm-up (the router may send it none of the burst)
        # has no gauge sample now (one CI run): join on the test's last 30 min.
        joined = prom.api("query", query=f'{ttft_by_engine} * on (ReplicaId) group_left max by (ReplicaId) '
                                         f'(max_over_time(ray_vllm_kv_cache_usage_perc{{{sel}}}[30m]))')["result"]
        assert set(served) <= {r["metric"]["ReplicaId"] for r in joined}, joined
        # The client's own exporter, scraped beside the servers: every token the readers got.
        assert prom.value(f'sum(tokenflow_client_tokens_total{{{sel}, run="test"}})') == sent_tokens
        assert prom.value(f'sum(tokenflow_client_requests_total{{{sel}, run="test", outcome="ok"}})') == sent_requests
        gone = [e for e in engines if e not in served]
        assert all(after.get(e, 0) == base_by_engine.get(e, 0) for e in gone), (gone, after, base_by_engine)
        # The drill-down shows the live engine that served most of the burst
        # (a replaced one's id may tie with it at no traffic).
        busiest = max(served, key=lambda e: after.get(e, 0) - base_by_engine.get(e, 0))

        time.sleep(2)  # a few more scrapes after the last export
        empty = []
        for name, dash in _dashboards().items():
            for var in dash["templating"]["list"]:
                if var["type"] == "query":
                    m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
                    series = prom.api("series", **{"match[]": _substitute(m.group(1), model, busiest)})
                    if not any(m.group(2) in s for s in series):
                        empty.append(f"{name}: variable {var['name']}")
            for title, expr in _targets(dash):
                q = _substitute(expr, model, busiest)
                res = prom.api("query_range", query=q, start=start - 5, end=time.time(), step=1)["result"]
                finite = [v for s in res for _, v in s["values"] if math.isfinite(float(v))]
                if not finite:
                    empty.append(f"{name} / {title}: {q}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
    finally:
        prom.stop()
        client_metrics.close()
