"""The slack router at 100 engines (`tokenflow bench-router`, docs/SCALING.md):
the real state board and ingress routing code against stand-in engines in a
Ray instance of the bench's own."""

import json
import subprocess
import sys

import pytest


def bench_router(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "bench-router", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_hundred_engines_are_routed_by_slack_from_fresh_states(tmp_path):
    out = tmp_path / "bench-router"
    r = bench_router("--engines", "100", "--seconds", "5", "--warmup", "2", "--fleets", "2", "--no-plots",
                     "--out", str(out))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    [row] = json.loads((out / "summary.json").read_text())["rows"]
    print("\n" + json.dumps(row))
    assert row["engines"] == 100 and row["rows_per_ingress"] == 64  # the head, not the whole cluster
    # Every push the fleets sent reached the board, and each ingress kept up with its stream. The fleets are
    # simulated on the same 2 cores, so they may send fewer than the 1,000/s offered (one CI run: 780 sent,
    # 781 handled); the board is judged on what it was sent, and the load must still be at least half the offer.
    assert row["pushes_sent_per_s"] >= 0.5 * row["pushes_offered_per_s"], row
    assert row["pushes_handled_per_s"] >= 0.95 * row["pushes_sent_per_s"], row
    assert row["decisions"] >= 0.8 * row["requests_per_s"] * 5 and row["fallbacks"] == 0, row
    # Routed by slack: a random choice would land at the 50th percentile.
    assert row["slack_percentile_mean"] >= 75, row
    # Fresh states and quick choices (targets: 250 ms and 1 ms at P99, here with room for a busy 2-core VM).
    # A choice is judged by its own CPU time: on 2 shared cores its wall time at P99 is mostly the waits for a
    # core (CI runs: 5.1 ms wall, 1.4 ms CPU; 16 ms wall, 3.9 ms CPU). The bounds catch a choice that does
    # work per engine in the cluster or waits on a call; the 1 ms target is judged by bench-router.
    assert row["age_p99_ms"] < 1000 and row["choose_cpu_p99_ms"] < 10 and row["choose_p99_ms"] < 50, row
    # Where the age goes: a row waits in its relay at most about a push interval, and in the ingress at most
    # about a refresh interval (0.1 s and 0.05 s here), less than the whole age.
    assert 0 < row["relay_wait_p50_ms"] <= row["age_p50_ms"] and 0 < row["since_answer_p50_ms"] <= row["age_p50_ms"], row
    assert "| engines |" in r.stdout and "wrote" in r.stdout


def test_bad_arguments_get_a_message_and_exit_2():
    r = bench_router("--engines", "0,10", timeout=60)
    assert r.returncode == 2 and "--engines" in r.stderr, r.stderr
    r = bench_router("--seconds", "inf", timeout=60)
    assert r.returncode == 2 and "--seconds" in r.stderr, r.stderr
    r = bench_router("--relay-interval", "0", timeout=60)
    assert r.returncode == 2 and "--relay-interval" in r.stderr, r.stderr
