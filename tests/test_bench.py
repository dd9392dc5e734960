"""`tokenflow bench` end to end on a tiny workload."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engines import ensure_model

KEYS = {"completed", "failed", "ttft_p50_s", "ttft_p99_s", "tbt_p99_s", "stall_s_mean", "throughput_tps",
        "effective_throughput_tps", "qoe_mean"}


@pytest.mark.slow
def test_bench_writes_summary_for_all_schedulers(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.cli", "bench", "--out", str(out), "--requests", "12",
         "--output-tokens", "24", "--prompt-tokens", "16", "--kv-bytes", str(1 << 20),
         "--max-num-seqs", "8", "--max-model-len", "256", "--model", ensure_model(),
         "--tokenflow", '{"dt": 0.02}', "--workload", "gamma", "--load", "0.3"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"fcfs", "andes", "tokenflow"}
    assert "engine-side" in summary["workload"]["timing"]
    # No GPU here: every scheduler ran synchronously, and the summary says so.
    assert summary["workload"]["engine"]["scheduling"] == "sync"
    # Arrivals sized to 0.3x of the capacity measured first.
    cal = summary["workload"]["calibration"]
    assert cal["decode_tps"] > 0 and cal["load"] == 0.3
    assert summary["workload"]["poisson_rate"] == pytest.approx(0.3 * cal["decode_tps"] / 24)
    for name, res in summary["results"].items():
        assert KEYS <= set(res), name
        assert res["completed"] == 12 and res["failed"] == 0, name
        assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"]
        assert res["effective_throughput_tps"] <= res["throughput_tps"] + 1e-9
        assert 0 < res["qoe_mean"] <= 1
        lines = (out / f"requests-{name}.jsonl").read_text().splitlines()
        assert len(lines) == 12 and all(json.loads(x)["tokens"] == 24 for x in lines)
    for png in ("ttft_cdf.png", "throughput.png", "token_timelines.png", "buffer_occupancy.png"):
        assert (out / png).stat().st_size > 1000


def test_bench_rejects_bad_arguments():
    for args in (["--workload", "zigzag"], ["--rates", "-1"], ["--engine-args", "{not json"]):
        r = subprocess.run([sys.executable, "-m", "tokenflow.cli", "bench", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert "error" in r.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """scripts/gpu_check.sh's code path, on CPU with the tiny model: the
    engine burst pauses and every output equals stock vLLM's."""
    r = subprocess.run(
        [sys.executable, "-m", "tokenflow.cli", "gpu-check", "--tiny", "--skip-bench", "--out", str(tmp_path),
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
