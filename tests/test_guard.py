"""tokenflow/serve/guard.py on small real ASGI apps through httpx (no Serve, fast).

The live app (tests/test_reliability.py) runs with no keys and a large bound;
here the same middleware runs with keys and tiny bounds."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tokenflow.serve import guard
from tokenflow.serve.guard import AdmissionSettings, TokenFlowGuard, admission_view, load_api_keys


def make_app(gate: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if gate is not None:
            await gate.wait()
        return {"echo": body}

    @app.post("/v1/stream")
    async def stream():
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def run(coro):
    return asyncio.run(coro)


async def call(asgi, method, path, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as c:
        return await c.request(method, path, **kw)


def assert_openai_error(r, status, type_):
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_ and err["message"]


# --- API keys -----------------------------------------------------------------

def test_keys_from_env_and_file(tmp_path):
    assert load_api_keys({}) is None
    assert load_api_keys({"TOKENFLOW_API_KEYS": "  "}) is None
    assert load_api_keys({"TOKENFLOW_API_KEYS": "a, b,,c "}) == {"a", "b", "c"}
    f = tmp_path / "keys"
    f.write_text("# comment\nk1\n\n  k2  \n")
    assert load_api_keys({"TOKENFLOW_API_KEYS_FILE": str(f)}) == {"k1", "k2"}
    assert load_api_keys({"TOKENFLOW_API_KEYS_FILE": str(f), "TOKENFLOW_API_KEYS": "a"}) == {"k1", "k2", "a"}
    (tmp_path / "empty").write_text("# nothing\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(guard.KeyFileError):
            load_api_keys({"TOKENFLOW_API_KEYS_FILE": str(bad)})


def test_no_keys_means_no_auth():
    asgi = TokenFlowGuard(make_app(), environ={})
    assert not asgi.auth_enabled
    r = run(call(asgi, "POST", "/v1/completions", json={"prompt": "hi"}))
    assert r.status_code == 200 and r.json() == {"echo": {"prompt": "hi"}}


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": "bearer"}, {"Authorization": "Basic s3cret"},
    {"Authorization": "Bearer s3cret-but-longer"}, {"Authorization": "s3cret"},
])
def test_bad_or_missing_key_gets_401(headers):
    asgi = TokenFlowGuard(make_app(), environ={"TOKENFLOW_API_KEYS": "s3cret,other"})
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/v1/stream")):
        r = run(call(asgi, method, path, json={"prompt": "hi"}, headers=headers))
        assert_openai_error(r, 401, "AuthenticationError")
        assert r.headers["www-authenticate"] == "Bearer"
        assert "s3cret" not in r.text


def test_valid_key_passes_and_health_stays_open():
    asgi = TokenFlowGuard(make_app(), environ={"TOKENFLOW_API_KEYS": "s3cret,other"})
    for key in ("s3cret", "other"):
        r = run(call(asgi, "POST", "/v1/completions", json={"p": 1}, headers={"Authorization": f"Bearer {key}"}))
        assert r.status_code == 200 and r.json() == {"echo": {"p": 1}}
    r = run(call(asgi, "POST", "/v1/stream", headers={"Authorization": "Bearer other"}))
    assert r.status_code == 200 and r.text.count("data:") == 3
    assert run(call(asgi, "GET", "/health")).json() == {"status": "ok"}


def test_unreadable_key_file_fails_closed(tmp_path):
    asgi = TokenFlowGuard(make_app(), environ={"TOKENFLOW_API_KEYS_FILE": str(tmp_path / "nope")})
    r = run(call(asgi, "GET", "/v1/models", headers={"Authorization": "Bearer anything"}))
    assert_openai_error(r, 401, "AuthenticationError")
    assert run(call(asgi, "GET", "/health")).status_code == 200


def test_install_reads_keys_from_the_serving_process_env(monkeypatch):
    """guard.install (what tokenflow/serve/app.py calls): keys come from the env
    when the app first serves, not from the install-time arguments."""
    app = make_app()
    guard.install(app, {"max_ongoing_requests": 4})
    monkeypatch.setenv("TOKENFLOW_API_KEYS", "envkey")
    monkeypatch.delenv("TOKENFLOW_API_KEYS_FILE", raising=False)
    assert run(call(app, "GET", "/v1/models")).status_code == 401
    assert run(call(app, "GET", "/v1/models", headers={"Authorization": "Bearer envkey"})).status_code == 200


# --- admission bound ------------------------------------------------------------

def test_admission_bound_gives_429_with_retry_after_then_recovers():
    async def scenario():
        gate = asyncio.Event()
        asgi = TokenFlowGuard(make_app(gate), admission={"max_ongoing_requests": 3, "retry_after_s": 2.5},
                              environ={})
        held = [asyncio.create_task(call(asgi, "POST", "/v1/completions", json={"i": i})) for i in range(3)]
        for _ in range(1000):  # bounded: wait until all three are admitted and parked
            if asgi.ongoing == 3:
                break
            await asyncio.sleep(0.001)
        assert asgi.ongoing == 3
        over = await call(asgi, "POST", "/v1/completions", json={"i": 99})
        assert_openai_error(over, 429, "RateLimitError")
        assert over.headers["retry-after"] == "3"  # whole seconds, rounded up
        # GETs and /health are not counted
        assert (await call(asgi, "GET", "/v1/models")).status_code == 200
        gate.set()
        done = await asyncio.gather(*held)
        assert [r.json()["echo"]["i"] for r in done] == [0, 1, 2]
        assert asgi.ongoing == 0  # every slot given back, the 429 included
        after = await call(asgi, "POST", "/v1/completions", json={"i": 4})
        assert after.status_code == 200
    run(scenario())


def test_ongoing_count_released_on_error_and_stream():
    async def boom_app(scope, receive, send):
        raise RuntimeError("handler blew up")

    async def scenario():
        asgi = TokenFlowGuard(boom_app, admission={"max_ongoing_requests": 1}, environ={})
        with pytest.raises(RuntimeError):
            await call(asgi, "POST", "/v1/completions", json={})
        assert asgi.ongoing == 0
        asgi2 = TokenFlowGuard(make_app(), admission={"max_ongoing_requests": 1}, environ={})
        for _ in range(3):
            assert (await call(asgi2, "POST", "/v1/stream")).status_code == 200
        assert asgi2.ongoing == 0
    run(scenario())


def test_serve_backpressure_503_becomes_429():
    """Ray Serve raises BackPressureError when an engine deployment's
    max_queued_requests is exceeded; Ray Serve LLM's ingress exception handling
    turns it into a 503 JSON error, which the guard rewrites."""
    from ray.serve.exceptions import BackPressureError

    from tokenflow.serve.ray_private import init_fastapi as init

    def build():
        app = init()  # the ingress's own FastAPI app with Ray's exception middleware

        @app.post("/v1/completions")
        async def completions():
            raise BackPressureError(num_queued_requests=5, max_queued_requests=5)

        @app.post("/v1/unavailable")
        async def unavailable():
            from fastapi.responses import JSONResponse
            return JSONResponse({"error": {"message": "down", "code": 503}}, status_code=503)
        return app

    plain = run(call(build(), "POST", "/v1/completions", json={}))
    assert plain.status_code == 503 and "backpressure" in plain.text.lower()
    app = build()
    guard.install(app, {"retry_after_s": 1})
    r = run(call(app, "POST", "/v1/completions", json={}))
    assert_openai_error(r, 429, "RateLimitError")
    assert r.headers["retry-after"] == "1"
    other = run(call(app, "POST", "/v1/unavailable", json={}))  # other 503s pass unchanged
    assert other.status_code == 503 and other.json()["error"]["message"] == "down"


# --- body size ------------------------------------------------------------------

def test_body_over_limit_gets_413_declared_or_chunked():
    asgi = TokenFlowGuard(make_app(), admission={"max_body_bytes": 1000}, environ={})
    r = run(call(asgi, "POST", "/v1/completions", content=b"x" * 1001,
                 headers={"content-type": "application/json"}))
    assert_openai_error(r, 413, "RequestTooLargeError")

    async def chunks():
        for _ in range(5):
            yield b"y" * 300
    r = run(call(asgi, "POST", "/v1/completions", content=chunks(), headers={"content-type": "application/json"}))
    assert_openai_error(r, 413, "RequestTooLargeError")
    assert asgi.ongoing == 0
    ok = run(call(asgi, "POST", "/v1/completions", content=json.dumps({"a": "b" * 900})))
    assert ok.status_code == 200


@pytest.mark.parametrize("bad", [
    {"max_ongoing_requests": 0}, {"max_ongoing_requests": 1.5}, {"max_ongoing_requests": True},
    {"retry_after_s": 0}, {"retry_after_s": float("nan")}, {"max_body_bytes": 0}, {"max_queue": 3},
])
def test_bad_admission_settings_fail_at_build(bad):
    with pytest.raises(ValueError):
        AdmissionSettings.from_dict(bad)


def test_yaml_configs_have_valid_admission_blocks():
    import yaml

    from tests.conftest import LOCAL_CONFIG
    for path in (LOCAL_CONFIG, LOCAL_CONFIG.replace("local.yaml", "gpu.yaml")):
        args = yaml.safe_load(open(path))["applications"][0]["args"]
        s = AdmissionSettings.from_dict(args["admission"])
        assert s.max_ongoing_requests >= 1 and s.retry_after_s > 0
        assert not any("key" in k.lower() for k in args), "API keys must never be in the YAML"


def test_non_json_content_type_gets_415_and_json_passes():
    asgi = TokenFlowGuard(make_app(), environ={})
    r = run(call(asgi, "POST", "/v1/completions", content=b'{"a": 1}', headers={"content-type": "text/plain"}))
    assert_openai_error(r, 415, "UnsupportedMediaTypeError")
    for ctype in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        r = run(call(asgi, "POST", "/v1/completions", content=b'{"a": 1}', headers={"content-type": ctype}))
        assert r.status_code == 200, ctype


def test_n_over_max_gets_400_on_generation_routes_only():
    asgi = TokenFlowGuard(make_app(), admission={"max_n": 4}, environ={})
    r = run(call(asgi, "POST", "/v1/completions", json={"prompt": "x", "n": 5}))
    assert_openai_error(r, 400, "BadRequestError")
    assert r.json()["error"]["message"] == "n x prompts must be at most 4, got 5"
    # n as the OpenAI handlers (pydantic, lax) read it, and batched prompts
    too_many = [b'{"prompt": "x", "n": "5"}', b'{"prompt": "x", "n": 5.0}', b'{"prompt": "x", "\\u006e": 1000}',
                b'{"prompt": ["a", "b", "c"], "n": 2}', b'{"prompt": [[1, 2], [3], [4], [5], [6]]}']
    for body in too_many:
        r = run(call(asgi, "POST", "/v1/completions", content=body, headers={"content-type": "application/json"}))
        assert_openai_error(r, 400, "BadRequestError")
    for body in ({"prompt": "x", "n": 4}, {"prompt": ["a", "b"], "n": 2}, {"prompt": [1, 2, 3, 4, 5], "n": 1},
                 {"prompt": "x"}, {"prompt": "x", "n": "many"}):
        assert run(call(asgi, "POST", "/v1/completions", json=body)).status_code == 200, body
    assert run(call(asgi, "POST", "/v1/completions", content=b"[1]")).status_code == 200  # app decides
    assert asgi.ongoing == 0


def test_every_route_but_health_needs_the_key_under_any_root_path():
    app = make_app()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return {"tokens": [1]}

    asgi = TokenFlowGuard(app, environ={"TOKENFLOW_API_KEYS": "s3cret"})
    for method, path in (("POST", "/tokenize"), ("GET", "/docs"), ("GET", "/openapi.json")):
        assert_openai_error(run(call(asgi, method, path, json={"prompt": "x"})), 401, "AuthenticationError")
    ok = run(call(asgi, "POST", "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"}))
    assert ok.status_code == 200
    assert run(call(asgi, "GET", "/health")).status_code == 200

    async def under_prefix(path: str, **kw):  # a route_prefix of /llm: Serve sets root_path
        async def root_app(scope, receive, send):
            return await asgi(dict(scope, root_path="/llm"), receive, send)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=root_app), base_url="http://t") as c:
            return await c.post(path, **kw)
    assert_openai_error(run(under_prefix("/llm/v1/completions", json={"n": 1})), 401, "AuthenticationError")


def test_slow_body_gets_408_and_frees_its_slot():
    asgi = TokenFlowGuard(make_app(), admission={"max_ongoing_requests": 1, "body_timeout_s": 0.2}, environ={})

    async def trickle():
        yield b'{"prompt": '
        await asyncio.sleep(2.0)
        yield b'"x"}'

    async def scenario():
        slow = asyncio.ensure_future(call(asgi, "POST", "/v1/completions", content=trickle(),
                                          headers={"content-type": "application/json"}))
        await asyncio.sleep(0.1)
        # GET /v1/tokenflow/engines shows the slot held (guard.admission_view).
        held = admission_view()
        assert held["requests_in_flight"] == 1, held
        assert_openai_error(await slow, 408, "RequestTimeoutError")
        assert asgi.ongoing == 0 and admission_view()["requests_in_flight"] == 0
        good = await call(asgi, "POST", "/v1/completions", json={"prompt": "y"})
        assert good.status_code == 200
    run(scenario())


def test_app_args_admission_block_is_validated_and_defaulted():
    from tokenflow.serve.app import resolve_args

    assert resolve_args({})["admission"] == AdmissionSettings().to_dict()
    assert resolve_args({"admission": {"max_ongoing_requests": 5}})["admission"]["max_ongoing_requests"] == 5
    with pytest.raises(ValueError):
        resolve_args({"admission": {"max_ongoing_requests": 0}})
    with pytest.raises(ValueError):
        resolve_args({"admission": {"api_keys": ["k"]}})  # keys are env-only


def test_readiness_probe_passes_the_guard_when_keys_are_on(monkeypatch):
    """`make serve` / bench-app wait for a completion to succeed: with keys
    on they must send one (they read it from the env the app reads)."""
    import socket
    import threading
    import time

    import uvicorn

    from tokenflow.tools import launcher

    monkeypatch.setenv("TOKENFLOW_API_KEYS", "s3cret")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(TokenFlowGuard(make_app()), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        assert not launcher.probe(base, "m")  # no key: the guard's 401
        assert launcher.probe(base, "m", api_key=launcher.api_key_from_env())
        assert launcher.wait_until_ready(base, "m", timeout=10)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_auth_off_is_said_in_the_log():
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("ray.serve")
    log.addHandler(handler)
    try:
        TokenFlowGuard(make_app(), environ={})
        TokenFlowGuard(make_app(), environ={"TOKENFLOW_API_KEYS": " "})
        TokenFlowGuard(make_app(), environ={"TOKENFLOW_API_KEYS": "k"})
    finally:
        log.removeHandler(handler)
    said = [r.getMessage() for r in records]
    assert len(said) == 2 and all("authentication is OFF" in m for m in said), said
    assert "neither TOKENFLOW_API_KEYS" in said[0] and "holds no key" in said[1]


def test_keys_in_the_app_env_reach_the_ingress():
    """The app args' `env` is the replicas' environment: keys given there
    must guard the ingress (which reads them), not only reach the engines."""
    from tokenflow.serve.app import build_app

    app = build_app({"env": {"TOKENFLOW_API_KEYS": "k1,k2", "OMP_NUM_THREADS": "1"},
                     "kv_pool": {"enabled": False}})
    options = app._bound_deployment.ray_actor_options
    assert options["runtime_env"]["env_vars"] == {"TOKENFLOW_API_KEYS": "k1,k2"}
    assert "runtime_env" not in (build_app({"kv_pool": {"enabled": False}})._bound_deployment.ray_actor_options
                                 or {})


# --- time limits, keepalives, GETs -----------------------------------------------

def timed_app(events: list) -> FastAPI:
    """Generation routes that are slow in the ways the limits are for; each
    records in `events` whether its work was cancelled."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "sleep" in body:  # slow before any response: a whole answer, or a stream yet to begin
            try:
                await asyncio.sleep(body["sleep"])
            except asyncio.CancelledError:
                events.append("whole cancelled" if not body.get("stream") else "unstarted stream cancelled")
                raise
            if not body.get("stream"):
                return {"text": "done"}

        async def gen():
            try:
                await asyncio.sleep(body.get("before_first", 0))  # parked before its first token
                for i in range(body.get("events", 3)):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(body.get("gap", 0))  # a paused reader: nothing to send
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                events.append("stream cancelled")
                raise
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/v1/slow")
    async def slow():
        await asyncio.sleep(0.3)
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def test_no_first_token_in_time_gets_504_and_the_work_is_cancelled():
    async def scenario():
        events = []
        asgi = TokenFlowGuard(timed_app(events), admission={"first_token_timeout_s": 0.3}, environ={})
        # No response yet (as Serve LLM's ingress holds it until the first chunk): a 504 JSON error.
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "sleep": 5})
        assert_openai_error(r, 504, "TimeoutError")
        assert "No token within 0.3 s" in r.text
        # Its headers out but no token: the error as an SSE event, then [DONE].
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "before_first": 5})
        parts = [p for p in r.text.split("\n\n") if p]
        assert r.status_code == 200 and len(parts) == 2 and parts[-1] == "data: [DONE]", parts
        assert json.loads(parts[0][6:])["error"]["type"] == "TimeoutError"
        assert events == ["unstarted stream cancelled", "stream cancelled"] and asgi.ongoing == 0
        # A whole (non-streaming) answer is not held to the first-token limit.
        r = await call(asgi, "POST", "/v1/completions", json={"sleep": 0.6})
        assert r.status_code == 200 and r.json() == {"text": "done"}
    run(scenario())


def test_a_request_over_its_time_limit_ends_cleanly_and_is_cancelled():
    async def scenario():
        events = []
        asgi = TokenFlowGuard(timed_app(events), admission={"request_timeout_s": 0.5}, environ={})
        # A stream that has begun: what it sent, then the error event and [DONE].
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "events": 50, "gap": 0.1})
        parts = [p for p in r.text.split("\n\n") if p]
        assert r.status_code == 200 and parts[0] == "data: 0" and 2 <= len(parts) - 2 < 50, parts
        assert json.loads(parts[-2][6:])["error"] == {
            "message": "The request took longer than 0.5 s; the request was cancelled", "type": "TimeoutError",
            "code": 504}
        assert parts[-1] == "data: [DONE]"
        # A whole answer: 504 JSON.
        r = await call(asgi, "POST", "/v1/completions", json={"sleep": 5})
        assert_openai_error(r, 504, "TimeoutError")
        assert events == ["stream cancelled", "whole cancelled"] and asgi.ongoing == 0
        # Within the limit, untouched.
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "events": 2})
        assert r.text == "data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
    run(scenario())


def test_a_quiet_stream_gets_keepalive_comments_and_a_busy_one_none():
    async def scenario():
        events = []
        asgi = TokenFlowGuard(timed_app(events), admission={"keepalive_s": 0.1}, environ={})
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "events": 2, "gap": 0.45})
        parts = [p for p in r.text.split("\n\n") if p]
        assert parts[0] == "data: 0" and parts[-1] == "data: [DONE]"
        between = parts[1:parts.index("data: 1")]
        assert 2 <= len(between) <= 5 and set(between) == {": keepalive"}, parts  # comments: clients skip them
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "events": 3})
        assert ": keepalive" not in r.text and events == []
    run(scenario())


def test_gets_in_flight_are_bounded_but_health_is_not():
    async def scenario():
        asgi = TokenFlowGuard(timed_app([]), admission={"max_ongoing_gets": 2}, environ={})
        slow = [asyncio.create_task(call(asgi, "GET", "/v1/slow")) for _ in range(2)]
        for _ in range(1000):
            if asgi.ongoing_gets == 2:
                break
            await asyncio.sleep(0.001)
        over = await call(asgi, "GET", "/v1/slow")
        assert_openai_error(over, 429, "RateLimitError")
        assert (await call(asgi, "GET", "/health")).status_code == 200
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
        assert asgi.ongoing_gets == 0 and (await call(asgi, "GET", "/v1/slow")).status_code == 200
    run(scenario())


def test_total_tokens_and_json_depth_are_bounded():
    async def scenario():
        asgi = TokenFlowGuard(make_app(), admission={"max_request_tokens": 300, "max_json_depth": 8}, environ={})
        for path, body in (("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 100}),
                           ("/v1/chat/completions", {"messages": [], "n": 4, "max_completion_tokens": "80"})):
            r = await call(asgi, "POST", path, json=body)
            assert_openai_error(r, 400, "BadRequestError")
            assert "must be at most 300 tokens" in r.json()["error"]["message"]
        ok = await call(asgi, "POST", "/v1/completions", json={"prompt": "a", "n": 3, "max_tokens": 100})
        assert ok.status_code == 200
        for depth in (9, 100_000):  # past the limit; past what a recursive parser survives
            raw = b'{"prompt": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
            r = await call(asgi, "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert_openai_error(r, 400, "BadRequestError")
            assert r.json()["error"]["message"] == "JSON nested deeper than 8 levels"
        raw = b'{"prompt": ' + b"[" * 7 + b"]" * 7 + b"}"  # 8 levels: fine
        r = await call(asgi, "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and asgi.ongoing == 0
    run(scenario())


def test_the_continuation_and_rebalance_opt_outs_must_be_booleans():
    async def scenario():
        asgi = TokenFlowGuard(make_app(), environ={})
        for key in ("tokenflow_continuation", "tokenflow_rebalance"):
            for bad in ("no", 0, 1, None, []):
                body = {"prompt": "a", "max_tokens": 4, "stream": True, key: bad}
                r = await call(asgi, "POST", "/v1/completions", json=body)
                assert_openai_error(r, 400, "BadRequestError")
                assert r.json()["error"]["message"].startswith(f"{key} must be true or false, got ")
            for good in (True, False):
                body = {"prompt": "a", "max_tokens": 4, "stream": True, key: good}
                assert (await call(asgi, "POST", "/v1/completions", json=body)).status_code == 200
        assert asgi.ongoing == 0
    run(scenario())


def test_pinning_a_request_to_an_engine_needs_the_app_to_allow_it():
    async def scenario():
        body = {"prompt": "a", "max_tokens": 4, "tokenflow_engine": "abc123"}
        closed = TokenFlowGuard(make_app(), environ={})
        r = await call(closed, "POST", "/v1/completions", json=body)
        assert_openai_error(r, 400, "BadRequestError")
        assert r.json()["error"]["message"] == ("tokenflow_engine is not allowed here (the app's "
                                                "admission.engine_pinning is off)")
        open_ = TokenFlowGuard(make_app(), admission={"engine_pinning": True}, environ={})
        for bad in (5, "", ["abc"], "x" * 201):
            r = await call(open_, "POST", "/v1/chat/completions", json={**body, "tokenflow_engine": bad})
            assert_openai_error(r, 400, "BadRequestError")
            assert r.json()["error"]["message"].startswith("tokenflow_engine must be an engine id (a string), got ")
        assert (await call(open_, "POST", "/v1/completions", json=body)).status_code == 200
        assert closed.ongoing == open_.ongoing == 0
    run(scenario())


def test_with_every_time_limit_off_a_request_runs_as_is():
    async def scenario():
        events = []
        off = {"first_token_timeout_s": None, "request_timeout_s": None, "keepalive_s": None}
        asgi = TokenFlowGuard(timed_app(events), admission=off, environ={})
        r = await call(asgi, "POST", "/v1/completions", json={"stream": True, "events": 2, "gap": 0.3})
        assert r.text == "data: 0\n\ndata: 1\n\ndata: [DONE]\n\n" and events == []
    run(scenario())
