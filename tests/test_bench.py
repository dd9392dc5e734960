"""`tokenflow bench` end to end on a tiny workload."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import yaml

from tests.engines import ensure_model

KEYS = {"completed", "failed", "ttft_p50_s", "ttft_p99_s", "tbt_p99_s", "stall_s_mean", "throughput_tps",
        "effective_throughput_tps", "qoe_mean"}


@pytest.mark.slow
def test_bench_writes_summary_for_all_schedulers(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.tools.cli", "bench", "--out", str(out), "--requests", "12",
         "--output-tokens", "24", "--prompt-tokens", "16", "--kv-bytes", str(1 << 20),
         "--max-num-seqs", "8", "--max-model-len", "256", "--model", ensure_model(),
         "--tokenflow", '{"dt": 0.02}', "--workload", "gamma", "--load", "0.3", "--rounds", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"fcfs", "andes", "tokenflow"}
    assert summary["workload"]["order"] == ["fcfs", "andes", "tokenflow"]  # seed 0
    # Two rounds, the order rotated between them, pooled.
    assert summary["workload"]["round_orders"] == [["fcfs", "andes", "tokenflow"], ["andes", "tokenflow", "fcfs"]]
    assert "engine-side" in summary["workload"]["timing"]
    # No GPU here: every scheduler ran synchronously, and the summary says so.
    assert summary["workload"]["engine"]["scheduling"] == "sync"
    # Arrivals sized to 0.3x of the capacity measured first.
    cal = summary["workload"]["calibration"]
    assert cal["decode_tps"] > 0 and cal["load"] == 0.3
    assert summary["workload"]["poisson_rate"] == pytest.approx(0.3 * cal["decode_tps"] / 24)
    for name, res in summary["results"].items():
        assert KEYS <= set(res), name
        assert res["completed"] == 24 and res["failed"] == 0, name
        assert [r["completed"] for r in res["rounds"]] == [12, 12], name
        assert res["wall_s"] == pytest.approx(sum(r["wall_s"] for r in res["rounds"]))
        tokens = [r["throughput_tps"] * r["wall_s"] for r in res["rounds"]]
        assert res["throughput_tps"] == pytest.approx(sum(tokens) / res["wall_s"])
        assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"]
        assert res["effective_throughput_tps"] <= res["throughput_tps"] + 1e-9
        assert 0 < res["qoe_mean"] <= 1
        recs = [json.loads(x) for x in (out / f"requests-{name}.jsonl").read_text().splitlines()]
        assert len(recs) == 24 and all(x["tokens"] == 24 for x in recs)
        assert sorted(x["round"] for x in recs) == [0] * 12 + [1] * 12
    for png in ("ttft_cdf.png", "throughput.png", "token_timelines.png", "buffer_occupancy.png"):
        assert (out / png).stat().st_size > 1000


@pytest.mark.slow
def test_bench_lockstep_times_each_engine_on_its_own_work(tmp_path):
    """`tokenflow bench --lockstep`: the schedulers' engines take turns of a
    step each in one process, each timed on the clock of its own work, host
    KV tier included (each engine swaps its own connector in)."""
    out = tmp_path / "lockstep"
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.tools.cli", "bench", "--out", str(out), "--requests", "10",
         "--output-tokens", "32", "--prompt-tokens", "16", "--kv-bytes", str(1 << 20), "--offload-bytes",
         str(8 << 20), "--max-num-seqs", "8", "--max-model-len", "256", "--model", ensure_model(),
         "--tokenflow", '{"dt": 0.02}', "--workload", "poisson", "--poisson-rate", "20",
         "--schedulers", "fcfs", "tokenflow", "--lockstep", "--no-plots"],
        capture_output=True, text=True, timeout=600,
    )
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload"]["lockstep"] and "lockstep" in summary["workload"]["timing"]
    last_arrival = max(json.loads(x)["arrival_s"] for x in (out / "requests-fcfs.jsonl").read_text().splitlines())
    walls = []
    for name, res in summary["results"].items():
        assert res["completed"] == 10 and res["failed"] == 0, name
        recs = [json.loads(x) for x in (out / f"requests-{name}.jsonl").read_text().splitlines()]
        assert all(x["tokens"] == 32 and x["arrivals_s"][0] >= x["arrival_s"] for x in recs), name
        # Each clock runs through the arrivals and the work after them ...
        assert res["wall_s"] > last_arrival, name
        # ... and a first token takes a step or two of this engine's work,
        # whatever the other engine does meanwhile.
        assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"] < 0.5, name
        walls.append(res["wall_s"])
    assert sum(walls) < elapsed  # the engines shared the run's time
    # Each request's first token under both, paired.
    paired = summary["paired_ttft_tokenflow_minus_fcfs"]
    assert paired["requests"] == 10 and paired["p1_s"] <= paired["p50_s"] <= paired["p99_s"]
    assert abs(paired["p50_s"]) < 0.5


def test_lockstep_is_refused_off_the_cpu_backend(tmp_path, monkeypatch, capsys):
    """On an accelerator the paired engines would share one device: the bench
    says so and starts nothing. The platform is the one piece stood in for."""
    from tokenflow.tools import bench, cli

    monkeypatch.setattr(bench, "_on_cpu", lambda: False)
    assert cli.main(["bench", "--lockstep", "--out", str(tmp_path / "gpu")]) == 2
    assert "--lockstep runs on vLLM's CPU backend only" in capsys.readouterr().err
    assert not (tmp_path / "gpu" / "summary.json").exists()


def test_work_clock_counts_only_the_work_and_jumps_over_waits():
    from tokenflow.tools.bench_drive import WorkClock

    clock, inside = WorkClock(), []
    clock.wait_until(1.0)
    assert clock.now() == 1.0
    clock.work(lambda: (time.sleep(0.05), inside.append(clock.now())))
    assert 1.04 < inside[0] < clock.now() < 1.5  # it ran with the wall during the work ...
    time.sleep(0.05)
    stopped = clock.now()
    time.sleep(0.05)
    assert clock.now() == stopped  # ... and stands still between turns
    clock.wait_until(0.5)  # never backwards
    assert clock.now() == stopped


def test_bench_rejects_bad_arguments():
    for args in (["--workload", "zigzag"], ["--rates", "-1"], ["--engine-args", "{not json"], ["--rounds", "0"]):
        r = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "bench", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert "error" in r.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """scripts/gpu_check.sh's code path, on CPU with the tiny model: the
    engine burst pauses and every output equals stock vLLM's."""
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.tools.cli", "gpu-check", "--tiny", "--skip-bench", "--out", str(tmp_path),
         "--model-dir", ensure_model(), "--requests", "24", "--prompt-tokens", "16", "--output-tokens", "96",
         "--max-num-seqs", "16", "--max-model-len", "512", "--kv-bytes", str(2 << 20),
         "--offload-bytes", str(16 << 20), "--dt", "0.02"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["checks"]["outputs_equal_stock"]
    assert summary["tokenflow"]["pauses_hold"] + summary["tokenflow"]["pauses_release"] > 0
    assert summary["tokenflow"]["async_scheduling"] is False


VLLM_FIELDS = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
               "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
               "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "p99_e2el_ms"}


@pytest.mark.slow
def test_bench_app_end_to_end_one_policy_in_turn(tmp_path):
    """`tokenflow bench-app`, the apps one after the other: the policy's app
    started from local.yaml (one engine here, for time), a burst sized to
    0.6x of the capacity measured through the app, streamed over HTTP, the
    app stopped. One policy, for time (each is an app start of about a
    minute here): the test below runs all three, served together, and
    `run_order` (tested above) is all that tells the two modes' loops apart."""
    from tokenflow.tools import launcher

    out = tmp_path / "bench-app"
    shm_before = launcher.shm_names()
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.tools.cli", "bench-app", "--engines", "1", "--port", "8017",
         "--max-tokens", "32", "--load", "0.6", "--calibration-tokens", "48", "--rates", "10:1,40:1",
         "--readers-per-slot", "0", "--slo-ttft", "5", "--app-nice", "5", "--policies", "tokenflow",
         "--record-routing", "0.2", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "calibrating" in r.stderr and "tokenflow: 100%" in r.stderr  # the progress bars
    summary = json.loads((out / "summary.json").read_text())
    wl = summary["workload"]
    assert "client-side" in wl["timing"]
    # the app under test ran below the client's CPU priority
    assert wl["app_nice"] == 5 and all(a["niceness"] == 5 for a in wl["apps"].values())
    # ... its whole session too, where the kernel shares CPU by session first
    assert all(a["autogroup"] is None or a["autogroup"].endswith("nice 5") for a in wl["apps"].values())
    cal = wl["calibration"]
    assert cal["decode_tps"] > 0 and cal["load"] == 0.6 and cal["failed"] == 0
    # sized by the rates alone (mean reading rate 25), as asked
    assert wl["requests"] == max(1, round(0.6 * cal["decode_tps"] / 25.0)) and wl["rate_scale"] == 1.0
    n = wl["requests"]
    assert set(summary["results"]) == {"tokenflow"}
    for name, res in summary["results"].items():
        assert (KEYS | VLLM_FIELDS) <= set(res), name
        assert res["completed"] == n and res["failed"] == 0, name
        assert res["total_output_tokens"] == 32 * n
        # The weight lost past the readers' caps, by rate and by quarter: what effective throughput lacks.
        lost = res["effective_lost"]
        assert lost["tokens"] == pytest.approx(res["tokens"] - res["effective_throughput_tps"] * res["wall_s"],
                                               rel=1e-6, abs=1e-6)
        assert sum(lost["by_rate"].values()) == pytest.approx(lost["tokens"]) == pytest.approx(sum(lost["by_quarter"]))
        assert set(lost["by_rate"]) == {"10", "40"}
        stalls = res["stall_by_rate"]
        assert set(stalls) == {"10", "40"} and sum(x["requests"] for x in stalls.values()) == n
        assert {"busy_s", "busy_tps", "need_tps", "load"} <= set(res["load_seen"])
        assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"]
        assert 0 <= res["slo_attainment"] <= 1
        assert res["effective_throughput_tps"] <= res["throughput_tps"] + 1e-9
        engines = res["scheduler_stats"]  # the scheduler's totals, per engine, from the app itself
        assert len(engines) == 1 and {"pauses_hold", "pauses_release", "resumes"} <= set(*engines.values())
        assert [e["received"] for e in engines.values()] == [n]  # this run's requests, the calibration's not
        doc = yaml.safe_load((out / f"app-{name}.yaml").read_text())
        assert doc["applications"][0]["args"]["tokenflow"]["policy"] == name
        lines = [json.loads(x) for x in (out / f"requests-{name}.jsonl").read_text().splitlines()]
        assert len(lines) == n and all(x["ok"] and x["tokens"] == 32 and x["exact_counts"] for x in lines)
    assert summary["ratios_tokenflow_vs_fcfs"] is None  # no fcfs run to compare with
    # --record-routing: the slack router's table over the run, as its ingress held it.
    polls = [json.loads(x) for x in (out / "routing-tokenflow.jsonl").read_text().splitlines()]
    tables = [t for p in polls for t in p["routers"].values() if t["engines"]]
    assert tables and [p["t"] for p in polls] == sorted(p["t"] for p in polls)
    last = tables[-1]["engines"]
    assert len(last) == 1 and last[0]["routed"] >= n  # this run's requests (and the calibration's)
    assert {"pending", "slack_s", "age_s"} <= set(last[0])
    # ... and each of its choices once, with the engine's slack left then
    choices = [c for t in tables for c in t["choices"]]
    assert len(choices) >= n and [c["t"] for c in choices] == sorted(c["t"] for c in choices)
    assert all(c["ranked"][0][0] == last[0]["engine_id"] for c in choices)
    for png in ("ttft_cdf.png", "throughput.png", "token_timelines.png", "buffer_occupancy.png"):
        assert (out / png).stat().st_size > 1000
    with socket.socket() as sock:  # the last app is gone
        assert sock.connect_ex(("127.0.0.1", 8017)) != 0
    # The app started and stopped: it left none of vLLM's shared-memory files behind.
    left = [n for n in launcher.shm_names() - shm_before if n.startswith(launcher.SHM_LEFTOVERS)]
    assert not left, left


@pytest.mark.slow
def test_bench_app_together_serves_every_policy_at_once(tmp_path):
    """`tokenflow bench-app --together`, all three policies: one `serve run`
    holds an app per policy, each at /<policy> with one engine (local.yaml
    has two: each gets two thirds of a CPU), calibrated at once and sent
    the same schedule at once; a valid summary for each, the ratios, and
    each request's first tokens paired."""
    out = tmp_path / "together"
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.tools.cli", "bench-app", "--together", "--port", "8019",
         "--max-tokens", "32", "--load", "0.6", "--calibration-tokens", "48", "--rates", "10:1,40:1",
         "--readers-per-slot", "0.5", "--slo-ttft", "5", "--app-nice", "5", "--policies", "tokenflow", "fcfs",
         "andes", "--no-plots", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    wl = summary["workload"]
    assert wl["together"] and wl["order"] == ["tokenflow", "fcfs", "andes"] and "together" in wl["timing"]
    apps = yaml.safe_load((out / "app-together.yaml").read_text())["applications"]
    assert [(a["route_prefix"], a["args"]["tokenflow"]["policy"], a["args"]["num_replicas"]) for a in apps] == \
        [("/tokenflow", "tokenflow", 1), ("/fcfs", "fcfs", 1), ("/andes", "andes", 1)]
    assert len({a["name"] for a in apps}) == 3
    # three engines on the config's two CPUs: each engine's bundle shrinks to fit
    assert all(a["args"]["placement_group_config"]["bundles"] == [{"CPU": pytest.approx(2 / 3)}] for a in apps)
    cal = wl["calibration"]
    assert set(cal["per_app"]) == {"tokenflow", "fcfs", "andes"}
    assert all(x["decode_tps"] > 0 for x in cal["per_app"].values())
    assert cal["measured_with"] == "together" and cal["failed"] == 0
    # At least half a reader per slot of the app's one engine (32 slots), the
    # rates scaled down where that is more than the rates give, so that the
    # readers still need 0.6x of what was measured.
    n, by_rate = wl["requests"], max(1, round(0.6 * cal["decode_tps"] / 25.0))
    assert n == max(by_rate, 16), (n, cal)
    assert wl["rate_scale"] == (1.0 if n == by_rate else pytest.approx(0.6 * cal["decode_tps"] / (25.0 * n)))
    rates = [json.loads(x)["rate"] for x in (out / "requests-fcfs.jsonl").read_text().splitlines()]
    assert all(any(r == pytest.approx(v * wl["rate_scale"], rel=1e-3) for v in (10, 40)) for r in rates), rates
    engine_ids = []
    for name, res in summary["results"].items():
        assert (KEYS | VLLM_FIELDS) <= set(res), name
        assert res["completed"] == n and res["failed"] == 0 and res["total_output_tokens"] == 32 * n, name
        assert len(res["scheduler_stats"]) == 1, name  # this app's one engine, read at its own prefix
        assert [e["received"] for e in res["scheduler_stats"].values()] == [n], name
        engine_ids += list(res["scheduler_stats"])
        lines = [json.loads(x) for x in (out / f"requests-{name}.jsonl").read_text().splitlines()]
        assert sorted(x["id"] for x in lines) == list(range(n)) and all(x["ok"] for x in lines)
    assert set(summary["results"]) == {"tokenflow", "fcfs", "andes"}
    assert len(set(engine_ids)) == 3  # three apps, three engines
    assert set(summary["ratios_tokenflow_vs_fcfs"]) >= {"ttft_p99", "effective_throughput", "throughput"}
    paired = summary["paired_ttft_tokenflow_minus_fcfs"]
    assert paired["requests"] == n and paired["p1_s"] <= paired["p50_s"] <= paired["p99_s"]
    with socket.socket() as sock:  # every app is gone
        assert sock.connect_ex(("127.0.0.1", 8019)) != 0


def test_a_burst_sized_by_load_outnumbers_the_slots_and_keeps_the_load():
    """The readers need load x capacity either way; where the rates give
    fewer readers than `per_slot` per slot, there are that many, slower."""
    from dataclasses import replace

    from tokenflow.tools.bench_app import AppWorkload
    from tokenflow.tools.loadtest.shapes import mean_rate, parse_rates

    def need(wl):
        return wl.requests * mean_rate(parse_rates(wl.rates))

    base = AppWorkload(shape="burst", requests=1, rates="10:0.5,20:0.3,40:0.2", max_tokens=512, prompt="p",
                       load=1.4, per_slot=2.0)
    gpu = base.at_load(decode_tps=20_000.0, slots=256)  # the rates give 1,474 readers, past 512
    assert (gpu.requests, gpu.rates, gpu.rate_scale) == (1474, base.rates, 1.0)
    cpu = base.at_load(decode_tps=600.0, slots=64)  # the rates give 44 readers, under 128
    assert cpu.requests == 128 and cpu.rate_scale < 1 and need(cpu) == pytest.approx(1.4 * 600.0, rel=1e-3)
    assert [w for _, w in parse_rates(cpu.rates)] == [0.5, 0.3, 0.2]  # the mix's shape is kept
    unscaled = replace(base, per_slot=0.0).at_load(600.0, 64)
    assert (unscaled.requests, unscaled.rates, unscaled.rate_scale) == (44, base.rates, 1.0)
    bursts = AppWorkload(shape="bursts", requests=1, rates="20", max_tokens=64, prompt="p", load=0.6,
                         bursts=3, period=10.0, per_slot=1.0).at_load(600.0, 32)  # 18 a burst by the rate
    assert bursts.requests == 3 * 32 and need(bursts) == pytest.approx(3 * 0.6 * 600.0, rel=1e-3)
    poisson = AppWorkload(shape="poisson", requests=50, rates="20", max_tokens=100, prompt="p", arrival_rate=1.0,
                          load=0.3, per_slot=2.0).at_load(600.0, 64)
    assert (poisson.requests, poisson.rates, poisson.arrival_rate) == (50, "20", pytest.approx(1.8))


def test_a_runs_load_is_read_off_its_slots_busy_and_stalls_by_rate():
    """What the run met: the readers' need over what the app decoded while
    every slot streamed; and each reading rate's stalls."""
    from tokenflow.tools.bench_app import load_seen, stall_by_rate

    def rec(rate, arrivals, stall=0.0, ok=True):
        return {"rate": rate, "arrivals_s": arrivals, "stall_s": stall, "ok": ok}

    records = [rec(10.0, [0.0, 1.0, 2.0, 3.0, 4.0]), rec(20.0, [1.0, 2.0, 3.0], stall=1.5),
               rec(20.0, [3.5, 5.0, 6.0], stall=0.5), rec(5.0, [], ok=False)]
    # Two streams mid-answer over [1, 3) and [3.5, 4): 2.5 s holding 5 tokens
    # (a stream's last token ends it, so 3.0 and 4.0 fall outside).
    seen = load_seen(records, slots=2)
    assert seen["busy_s"] == pytest.approx(2.5) and seen["busy_tps"] == pytest.approx(2.0)
    assert seen["need_tps"] == 55.0 and seen["load"] == pytest.approx(27.5)
    assert load_seen(records, slots=3)["load"] is None  # never three at once
    by_rate = stall_by_rate(records)
    assert list(by_rate) == ["10", "20"]  # the failed request has no stall to count
    assert by_rate["20"] == {"requests": 2, "stall_s_mean": 1.0, "stall_s_max": 1.5}


def test_both_benches_rotate_the_order_with_the_seed():
    from tokenflow.tools.bench import run_order

    orders = [run_order(["fcfs", "andes", "tokenflow"], seed) for seed in (1, 2, 3)]
    assert orders[2] == ["fcfs", "andes", "tokenflow"] and [o[0] for o in orders] == ["andes", "tokenflow", "fcfs"]


def test_bench_app_rejects_bad_arguments(tmp_path):
    for args, msg in ((["--load", "-1"], "--load"), (["--readers-per-slot", "-1"], "--readers-per-slot"),
                      (["--rates", "fast"], "rate"),
                      (["--config", str(tmp_path / "none.yaml")], "no such config"),
                      (["--tokenflow", '{"policy": "fcfs"}'], "--tokenflow"),
                      (["--model", "other"], "model_id"), (["--app-nice", "30"], "--app-nice"), (["--shape", "bursts", "--load", "0"], "--period"),
                      (["--together", "--policies", "fcfs"], "--together")):
        r = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "bench-app", "--out", str(tmp_path), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert "error" in r.stderr and msg in r.stderr, (args, r.stderr)
