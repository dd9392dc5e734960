"""Bad input, the front door and client disconnects, against the live app.

Rows come from tests/reliability_cases.py, which docs/RELIABILITY.md is
generated from. To re-observe every row (e.g. after a vLLM upgrade):
    TOKENFLOW_RECORD_RELIABILITY=/tmp/obs.json pytest tests/test_reliability.py -k row
then copy status/message into CASES and run `python -m tests.reliability_cases`."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.reliability_cases import CASES, DOC, MODEL, message_of, normalize, render_doc

RECORD = os.environ.get("TOKENFLOW_RECORD_RELIABILITY")


def test_doc_matches_cases():
    assert all(c["status"] is not None for c in CASES), "every row needs its observed status"
    assert DOC.read_text() == render_doc(), "run: python -m tests.reliability_cases"
    assert len(CASES) >= 25 and len({c["name"] for c in CASES}) == len(CASES)


def _fill(value, model):
    if value == MODEL:
        return model
    if isinstance(value, dict):
        return {k: _fill(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, model) for v in value]
    return value


def send(serve_app, case):
    headers = {"Content-Type": "application/json", **(case.get("headers") or {})}
    if "raw" in case:
        content = case["raw"].replace(b"MODEL", serve_app["model"].encode())
    elif "body" in case:
        content = json.dumps(_fill(case["body"], serve_app["model"]))
    else:
        content = None
    return httpx.request(case.get("method", "POST"), serve_app["base_url"] + case["path"],
                         content=content, headers=headers, timeout=120)


def good_request_works(serve_app):
    r = httpx.post(serve_app["base_url"] + "/v1/completions", timeout=120,
                   json={"model": serve_app["model"], "prompt": "still there?", "max_tokens": 4})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_row(serve_app, case):
    r = send(serve_app, case)
    observed = {"name": case["name"], "status": r.status_code, "message": message_of(r)}
    if RECORD:
        with open(RECORD, "a") as f:
            f.write(json.dumps(observed) + "\n")
    else:
        assert (r.status_code, message_of(r)) == (case["status"], normalize(case["message"])), observed
        assert r.status_code < 500, "a bad request must never be a server error"
        if r.status_code >= 400:
            assert r.headers["content-type"].startswith("application/json")
    good_request_works(serve_app)


@pytest.mark.slow
def test_front_door_is_wired_with_keys_off(serve_app):
    """local.yaml with no TOKENFLOW_API_KEYS: no auth, and a log line that
    says so. The guard is there (the 8 MiB row above gets its 413), and
    requests without any Authorization header pass; /health is open."""
    assert "TOKENFLOW_API_KEYS" not in os.environ and "TOKENFLOW_API_KEYS_FILE" not in os.environ
    base = serve_app["base_url"]
    health = httpx.get(base + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = httpx.get(base + "/v1/models", timeout=30)
    assert r.status_code == 200 and serve_app["model"] in [m["id"] for m in r.json()["data"]]
    r = httpx.post(base + "/v1/completions", content=b'{"model": "x", "prompt": "' + b"a" * (9 * 2**20) + b'"}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    good_request_works(serve_app)
    if serve_app["log"] is not None:  # the app's log says so (Ray streams the ingress's log to `serve run`)
        deadline = time.monotonic() + 30
        while "TokenFlow guard: authentication is OFF" not in serve_app["log"].read_text(errors="replace"):
            assert time.monotonic() < deadline, "no log line saying that authentication is off"
            time.sleep(0.5)


def _scheduler_load(serve_app):
    engines = httpx.get(serve_app["base_url"] + "/v1/tokenflow/engines", timeout=30).json()["engines"]
    total = 0
    for e in engines:
        sched = e.get("scheduler") or {}
        total += sum(int(sched.get(k) or 0) for k in ("running", "waiting", "paused_hold", "paused_release"))
    return total, engines


@pytest.mark.slow
def test_client_disconnect_aborts_the_request_in_the_engine(serve_app):
    """A client that closes a long stream frees the engine: its sequences
    leave the schedulers' running/waiting/paused counts.

    n=16 x 2000 tokens (ignore_eos) is far more work than the polling window
    below, so the counts can only fall back this soon if the engine aborted
    the request. Other sessions may share the app: the check is that our 16
    sequences are gone (load <= load-while-open - 16), not that it is idle."""
    n = 16
    body = {"model": serve_app["model"], "prompt": "a very long story", "max_tokens": 2000, "n": n,
            "stream": True, "ignore_eos": True, "consumption_rate": 5}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", serve_app["base_url"] + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Keep the line iterator referenced: a dropped httpx iterator closes
            # the connection at once (that would be the disconnect, too early).
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            # seen in the engines while the stream is open (states are pushed every
            # 0.1 s); keep reading so the server is never blocked on the socket
            busy = 0
            for _ in range(40):
                for _ in range(50):
                    next(lines)
                busy, engines = _scheduler_load(serve_app)
                if busy >= n:
                    break
                time.sleep(0.25)
            assert busy >= n, engines
            r.close()  # the client disconnects mid-stream
            lines = None
    for _ in range(40):
        load, engines = _scheduler_load(serve_app)
        if load <= busy - n:
            break
        time.sleep(0.5)
    assert load <= busy - n, (busy, engines)
    good_request_works(serve_app)
