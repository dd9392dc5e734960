"""The Locust load test: per-request accounting, shapes, CLI, and one live run.

Locust monkeypatches whatever process imports it with gevent, so this file
never imports `locust` or tokenflow.tools.loadtest.locustfile: the accounting and shapes are
pure modules, and the run itself is a `tokenflow loadtest` subprocess."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys

import pytest

from tests.engines import ROOT
from tokenflow.tools.cli import main
from tokenflow.tools.loadtest.recorder import RequestRecorder, StreamError, sse_data
from tokenflow.tools.loadtest.runner import check_host, summarize
from tokenflow.tools.loadtest.shapes import arrival_offsets, draw_rates, make_schedule, parse_rates

# --- (a) accounting against a scripted stream ---------------------------------
#
# Reader at 4 tokens/s (one token per 0.25 s), request sent at t = 0:
#   t = 1.50  1 token   TTFT 1.5; buffer 0 before it
#   t = 1.75  1 token   reader just read token 1: buffer 0
#   t = 2.00  2 tokens  reader just read token 2: buffers 0 and 1 (one chunk)
#   t = 3.00  1 token   reader finished the 4 tokens at 2.5, stalled 0.5 s
# [DONE] at 3.25: no stall after the last token (the answer is complete).
# Weights (output 5 tokens; full below a 0.5-token buffer, zero at 1.0):
#   buffers [0, 0, 0, 1, 0] -> [1, 1, 1, 0, 1] -> 4 effective tokens.
# QoE: playhead area from 1.5 to the read end 3.25 is 0.5 + 1.5 + 2 + 1.125
#   = 41/8; expected curve (first token at 1.0, then 4/s, 5 tokens) area to
#   3.25 is 5 * 1.25 / 2 + 5 * 1.0 = 65/8; QoE = 41/65.
TIMELINE = [(1.5, 1), (1.75, 1), (2.0, 2), (3.0, 1)]


def _check_hand_timeline(rec: RequestRecorder):
    r = rec.result()
    assert rec.ttft == r["ttft_s"] == 1.5
    assert r["tokens"] == 5
    assert r["stall_s"] == 0.5
    assert rec.reader.buffer_at_arrival == [0, 0, 0, 1, 0]
    assert rec.reader.weights() == [1, 1, 1, 0, 1]
    assert r["effective_tokens"] == 4.0
    assert r["qoe"] == pytest.approx(41 / 65, abs=1e-12)
    assert r["tbt_s"] == [0.25, 0.25, 1.0]
    assert r["total_s"] == 3.25


def test_recorder_hand_timeline():
    rec = RequestRecorder(rate=4.0, sent_at=0.0)
    for t, n in TIMELINE:
        rec.on_tokens(t, n)
    rec.close(3.25)
    _check_hand_timeline(rec)
    assert rec.result()["chunks"] == [[t, n] for t, n in TIMELINE]


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())


def _chunk(content, usage=None, finish=None):
    c = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": content, "finish_reason": finish}]}
    if usage is not None:
        c["usage"] = {"prompt_tokens": 7, "completion_tokens": usage, "total_tokens": 7 + usage}
    return c


def test_recorder_sse_stream_with_continuous_usage():
    """Exact counts from cumulative usage: a two-token chunk and an empty
    (held-back text) chunk are both counted right."""
    rec = RequestRecorder(rate=4.0, sent_at=0.0)
    lines = [
        (1.2, _sse(_chunk({"role": "assistant", "content": ""}, usage=0))),
        (1.2, b""),  # SSE event separator
        (1.3, b": keep-alive comment"),
        (1.5, _sse(_chunk({"content": "a"}, usage=1))),
        (1.75, _sse(_chunk({"content": "b"}, usage=2))),
        (2.0, _sse(_chunk({"content": "cd"}, usage=4))),
        (2.5, _sse(_chunk({"content": ""}, usage=4))),
        (3.0, _sse(_chunk({"content": "e"}, usage=5, finish="length"))),
        (3.1, _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})),
    ]
    for t, line in lines:
        assert rec.on_line(t, line) is False
    assert rec.on_line(3.25, _sse(b"[DONE]")) is True
    rec.close(3.25)
    _check_hand_timeline(rec)
    r = rec.result()
    assert r["exact_counts"] and r["completion_tokens"] == 5 and r["prompt_tokens"] == 7
    assert r["finish_reason"] == "length"


def test_recorder_fallback_counts_chunks_and_reconciles_with_usage():
    """Without per-chunk usage, one token per chunk with text; the final usage
    adds the shortfall (the two-token chunk) when it arrives."""
    rec = RequestRecorder(rate=4.0, sent_at=0.0)
    rec.on_chunk(1.2, _chunk({"role": "assistant", "content": ""}))
    for t, text in [(1.5, "a"), (1.75, "b"), (2.0, "cd"), (2.5, ""), (3.0, "e")]:
        rec.on_chunk(t, _chunk({"content": text}))
    rec.on_chunk(3.1, {"choices": [], "usage": {"completion_tokens": 5}})
    rec.close(3.2)
    r = rec.result()
    assert r["tokens"] == 5 and not r["exact_counts"]
    assert r["chunks"] == [[1.5, 1], [1.75, 1], [2.0, 1], [3.0, 1], [3.1, 1]]


def test_recorder_errors_and_sse_lines():
    rec = RequestRecorder(rate=10.0, sent_at=0.0)
    with pytest.raises(StreamError, match="boom"):
        rec.on_line(1.0, _sse({"error": {"message": "boom", "code": 500}}))
    with pytest.raises(StreamError, match="undecodable"):
        rec.on_line(1.0, b"data: {not json")
    assert sse_data(b"data: [DONE]\r\n") == "[DONE]"
    assert sse_data("event: ping") is None and sse_data(b"") is None
    # A request that never got a token: no TTFT, no stall, QoE 0.
    rec.close(2.0)
    r = rec.result()
    assert r["ttft_s"] is None and r["stall_s"] is None and r["qoe"] == 0.0 and r["tokens"] == 0


# --- shapes and rate mixes --------------------------------------------------------


def test_parse_rates():
    assert parse_rates("10:0.5,20:0.3,40:0.2") == [(10, 0.5), (20, 0.3), (40, 0.2)]
    assert parse_rates("20") == [(20, 1.0)]
    for bad, msg in [("10:x", "bad rate entry"), ("0:1", "positive"), ("-5:1", "positive"),
                     ("10:-1", "non-negative"), ("10:0", "sum to zero"), ("10,,20", "empty entry"),
                     ("nan:1", "positive")]:
        with pytest.raises(ValueError, match=msg):
            parse_rates(bad)


def test_draw_rates_give_each_rate_its_share_in_a_seeded_order():
    mix = parse_rates("10:0.5,20:0.3,40:0.2")
    for n in (1, 7, 64, 10_000):
        draws = draw_rates(mix, n, seed=3)
        counts = {v: draws.count(v) for v in (10, 20, 40)}
        assert sum(counts.values()) == n
        # each rate's count is its quota rounded up or down: the readers need the mix's mean rate
        assert all(abs(counts[v] - w * n) < 1 for v, w in mix), (n, counts)
        assert draws == draw_rates(mix, n, seed=3)
    assert draw_rates(mix, 64, seed=4) != draw_rates(mix, 64, seed=3)  # the seed picks who reads at which rate
    assert sorted(draw_rates(mix, 64, seed=4)) == sorted(draw_rates(mix, 64, seed=3))
    assert draw_rates(parse_rates("10:1,30:0"), 3) == [10, 10, 10]


def test_burst_shapes():
    assert arrival_offsets("burst", 4) == [0.0] * 4
    assert arrival_offsets("bursts", 6, bursts=3, period=2.5) == [0, 0, 2.5, 2.5, 5.0, 5.0]
    with pytest.raises(ValueError, match="multiple of --bursts"):
        arrival_offsets("bursts", 7, bursts=3, period=1)
    with pytest.raises(ValueError, match="--period"):
        arrival_offsets("bursts", 6, bursts=3)


@pytest.mark.parametrize("shape,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_random_arrivals_have_the_stated_rate_and_burstiness(shape, cv):
    offsets = arrival_offsets(shape, 10_000, arrival_rate=5.0, cv=cv, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.06)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.1)
    assert offsets == arrival_offsets(shape, 10_000, arrival_rate=5.0, cv=cv, seed=1)


def test_schedule_validation():
    s = make_schedule("poisson", 5, "10:1,40:1", arrival_rate=2.0)
    assert len(s) == 5 and set(s.rates) <= {10, 40}
    for kwargs, msg in [(dict(shape="poisson"), "--arrival-rate"), (dict(shape="zigzag"), "unknown shape"),
                        (dict(shape="burst", requests=0), "between 1"),
                        (dict(shape="gamma", arrival_rate=1.0, cv=0), "--cv")]:
        kw = dict(requests=5, rates="20") | kwargs
        with pytest.raises(ValueError, match=msg):
            make_schedule(kw.pop("shape"), kw.pop("requests"), kw.pop("rates"), **kw)


def test_only_loopback_hosts_by_default():
    assert check_host("http://127.0.0.1:8000") and check_host("http://localhost:8000")
    assert check_host("http://[::1]:8000")
    with pytest.raises(ValueError, match="loopback"):
        check_host("http://10.0.0.5:8000")
    assert check_host("http://10.0.0.5:8000", allow_remote=True)
    with pytest.raises(ValueError, match="http"):
        check_host("127.0.0.1:8000")


def test_summarize():
    recs = [
        {"ok": True, "sent_s": 0.0, "total_s": 2.0, "ttft_s": 0.5, "tbt_s": [0.1], "stall_s": 0.0,
         "qoe": 1.0, "tokens": 10, "effective_tokens": 8.0},
        {"ok": True, "sent_s": 1.0, "total_s": 3.0, "ttft_s": 1.5, "tbt_s": [0.3], "stall_s": 1.0,
         "qoe": 0.5, "tokens": 10, "effective_tokens": 4.0},
        {"ok": False, "sent_s": None, "tokens": 0, "error": "stopped"},
    ]
    s = summarize(recs, requests=4)
    assert (s["completed"], s["failed"], s["wall_s"], s["tokens"]) == (2, 2, 4.0, 20)
    assert s["ttft_p50_s"] == 1.0 and s["stall_s_mean"] == 0.5 and s["qoe_mean"] == 0.75
    assert s["effective_throughput_tps"] == 3.0 and s["throughput_tps"] == 5.0


# --- (c) bad command lines ---------------------------------------------------------

BAD_ARGS = [
    (["--shape", "zigzag"], "invalid choice: 'zigzag'"),
    (["--rates", "10:x"], "bad rate entry"),
    (["--rates", "0:1"], "positive"),
    (["--requests", "0"], "positive integer"),
    (["--max-tokens", "many"], "positive integer"),
    (["--shape", "gamma", "--cv", "-1", "--arrival-rate", "2"], "positive number"),
]
BAD_COMBINATIONS = [
    (["--shape", "poisson"], "needs --arrival-rate"),
    (["--shape", "bursts", "--requests", "7", "--bursts", "2", "--period", "1"], "multiple of --bursts"),
    (["--host", "http://192.0.2.1:8000"], "not a loopback address"),
    (["--host", "localhost:8000"], "http(s) URL"),
]


@pytest.mark.parametrize("argv,msg", BAD_ARGS)
def test_cli_rejects_bad_arguments(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,msg", BAD_COMBINATIONS)
def test_cli_rejects_bad_combinations_before_starting(argv, msg, capsys, tmp_path):
    assert main(["loadtest", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenflow: error:") and msg in err
    assert not (tmp_path / "out").exists()


def test_bad_arguments_exit_nonzero_from_the_commands():
    """The same checks through the real processes: `tokenflow loadtest`, and
    the locustfile under the `locust` command."""
    p = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "loadtest", "--rates", "fast"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "argument --rates: bad rate entry 'fast'" in p.stderr
    p = subprocess.run([sys.executable, "-m", "locust", "-f", "tokenflow/tools/loadtest/locustfile.py", "--headless",
                        "--shape", "gamma", "--jsonl", "/dev/null"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs --arrival-rate" in p.stderr


# --- (b) a headless Locust run against the live app ------------------------------


@pytest.mark.slow
def test_burst_run_against_the_app(serve_app, tmp_path):
    out = tmp_path / "lt"
    max_tokens, n = 24, 6
    cmd = [sys.executable, "-m", "tokenflow.tools.cli", "loadtest", "--host", serve_app["base_url"],
           "--model", serve_app["model"], "--shape", "burst", "--requests", str(n),
           "--rates", "10:0.5,40:0.5", "--max-tokens", str(max_tokens), "--request-timeout", "240",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"sent {n}/{n}" in p.stdout and f"completed {n}  failed 0" in p.stdout

    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == list(range(n))
    for r in records:
        assert r["ok"] and r["error"] is None, r
        assert r["ttft_s"] > 0 and r["rate"] in (10, 40)
        assert r["tokens"] == r["completion_tokens"] == max_tokens and r["exact_counts"]
        assert sum(k for _, k in r["chunks"]) == max_tokens
        assert r["chunks"][0][0] == pytest.approx(r["ttft_s"], abs=1e-5)
        assert len(r["tbt_s"]) == len(r["chunks"]) - 1
        assert r["stall_s"] >= 0 and 0 < r["qoe"] <= 1 and 0 < r["effective_tokens"] <= max_tokens
        assert r["finish_reason"] == "length"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == n and summary["failed"] == 0 and summary["locust_exit_code"] == 0
    assert summary["ttft_p50_s"] > 0 and summary["effective_throughput_tps"] > 0

    with open(out / "locust_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    count = {t: sum(int(r["Request Count"]) for r in rows if r["Type"] == t) for t in ("CHAT", "TTFT", "STALL")}
    assert count == {"CHAT": n, "TTFT": n, "STALL": n}
    assert all(r["Failure Count"] == "0" for r in rows)
    assert (out / "locust_stats_history.csv").stat().st_size > 0
    html = (out / "report.html").read_text()
    assert "TTFT" in html and "/v1/chat/completions" in html
