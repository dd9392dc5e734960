"""Bad-input cases for the live app: the single source of truth for
tests/test_reliability.py and docs/RELIABILITY.md.

Each case: the request (path, JSON `body` or raw `raw` bytes, extra
headers, method) and the response observed on the live tests' app
(configs/local.yaml with engine pinning and rebalancing on; tests/conftest.py)
(`status`, and `message`: the JSON error message, compared exactly after
`normalize`). `note` goes to the doc.

    python -m tests.reliability_cases        # rewrite docs/RELIABILITY.md from CASES
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md"
MODEL = "MODEL"  # replaced by the app's model id
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


CASES = [
    dict(name="malformed JSON", path=CHAT, raw=b'{"model": "MODEL", "messages": [', status=400, message="Invalid request format: JSON decode error at ('body', 37)"),
    dict(name="body is a JSON array", path=CHAT, raw=b'[1, 2, 3]', status=400, message="Invalid request format: Input should be a valid dictionary or object to extract fields from at ('body',)"),
    dict(name="empty body", path=CHAT, raw=b"", status=400, message="Invalid request format: Field required at ('body',)"),
    dict(name="invalid UTF-8 bytes in body", path=COMP,
         raw=b'{"model": "MODEL", "prompt": "\xff\xfe\xc3\x28", "max_tokens": 2}', status=400, message='There was an error parsing the body'),
    dict(name="wrong content type (text/plain)", path=COMP, body=comp(),
         headers={"Content-Type": "text/plain"}, status=415, message="Unsupported Content-Type 'text/plain': send application/json"),
    dict(name="body over 8 MiB", path=COMP, raw=b'{"model": "MODEL", "prompt": "' + b"a" * (9 * 2**20) + b'"}',
         status=413, message='Request body larger than 8388608 bytes'),
    dict(name="GET on a POST route", path=COMP, method="GET", status=405, message='Method Not Allowed'),
    dict(name="unknown route", path="/v1/no-such-route", body=comp(), status=404, message='Not Found'),
    dict(name="missing model", path=COMP, body={"prompt": "hi", "max_tokens": 2}, status=200, message=None),
    dict(name="unknown model", path=COMP, body={**comp(), "model": "no-such-model"}, status=404, message='Got request for model "no-such-model". Could not find base model with ID "no-such-model".'),
    dict(name="model is a number", path=COMP, body={**comp(), "model": 7}, status=400, message="Invalid request format: Input should be a valid string at ('body', 'model')"),
    dict(name="missing messages", path=CHAT, body={"model": MODEL, "max_tokens": 2}, status=400, message="Invalid request format: Field required at ('body', 'messages')"),
    dict(name="messages is a string", path=CHAT, body=chat(messages="hi"), status=400, message="Invalid request format: Input should be a valid list at ('body', 'messages')"),
    dict(name="empty messages list", path=CHAT, body=chat(messages=[]), status=400, message='Message: Cannot apply chat template to an empty conversation. Provide at least one message. (Request ID: <id>)'),
    dict(name="unknown role", path=CHAT, body=chat(messages=[{"role": "wizard", "content": "hi"}]),
         status=200, message=None),
    dict(name="content is a number", path=CHAT, body=chat(messages=[{"role": "user", "content": 42}]),
         status=400, message="Invalid request format: Input should be a valid string at ('body', 'messages', 0, 'ChatCompletionDeveloperMessageParam', 'content', 'str')"),
    dict(name="3000 messages (over the context)", path=CHAT,
         body=chat(messages=[{"role": "user", "content": "hi"}] * 3000), status=400, message="Message: This model's maximum context length is 2048 tokens. However, your prompt contains 36014 characters (more than 18432 characters, which is the upper bound for 2048 input tokens). Please reduce the length of the input prompt. (parameter=input_text, value=36014) (Request ID: <id>)"),
    dict(name="empty prompt", path=COMP, body=comp(prompt=""), status=400, message='Message: vllm.exceptions.VLLMValidationError: Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt) (Request ID: <id>)'),
    dict(name="prompt is an object", path=COMP, body=comp(prompt={"text": "hi"}), status=400, message="Invalid request format: Input should be a valid list at ('body', 'prompt', 'list[constrained-int]')"),
    dict(name="prompt longer than the context", path=COMP, body=comp(prompt="river " * 5000),
         status=400, message="Message: This model's maximum context length is 2048 tokens. However, your prompt contains 30000 characters (more than 18432 characters, which is the upper bound for 2048 input tokens). Please reduce the length of the input prompt. (parameter=input_text, value=30000) (Request ID: <id>)"),
    dict(name="max_tokens negative", path=COMP, body=comp(max_tokens=-5), status=400, message='Message: max_tokens must be at least 1, got -5. (parameter=max_tokens, value=-5) (Request ID: <id>)'),
    dict(name="max_tokens zero", path=COMP, body=comp(max_tokens=0), status=400, message='Message: max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0) (Request ID: <id>)'),
    dict(name="max_tokens over the context", path=COMP, body=comp(max_tokens=100000), status=400, message='Message: max_tokens=100000 cannot be greater than max_model_len=2048. Please request fewer output tokens. (parameter=max_tokens, value=100000) (Request ID: <id>)'),
    dict(name="max_tokens is a string", path=COMP, body=comp(max_tokens="many"), status=400, message="Invalid request format: Input should be a valid integer, unable to parse string as an integer at ('body', 'max_tokens')"),
    dict(name="temperature negative", path=COMP, body=comp(temperature=-1), status=400, message='Message: temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0) (Request ID: <id>)'),
    dict(name="temperature 1000", path=COMP, body=comp(temperature=1000), status=400, message='Message: temperature must be in [0, 2], got 1000.0. (parameter=temperature, value=1000.0) (Request ID: <id>)'),
    dict(name="top_p 2", path=COMP, body=comp(top_p=2), status=400, message='Message: top_p must be in (0, 1], got 2.0. (parameter=top_p, value=2.0) (Request ID: <id>)'),
    dict(name="presence_penalty 10", path=COMP, body=comp(presence_penalty=10), status=400, message='Message: presence_penalty must be in [-2, 2], got 10.0. (Request ID: <id>)'),
    dict(name="n = 0", path=COMP, body=comp(n=0), status=400, message='Message: n must be at least 1, got 0. (Request ID: <id>)'),
    dict(name="n = 1000", path=COMP, body=comp(n=1000), status=400, message='n x prompts must be at most 16, got 1000'),
    dict(name="n = \"1000\" (a string)", path=COMP, body=comp(n="1000"), status=400,
         message='n x prompts must be at most 16, got 1000'),
    dict(name="20 prompts in one completion", path=COMP, body=comp(prompt=["hi"] * 20), status=400,
         message='n x prompts must be at most 16, got 20'),
    dict(name="completion logprobs 100", path=COMP, body=comp(logprobs=100), status=400, message='Message: Requested sample logprobs of 100, which is greater than max allowed: 20 (parameter=logprobs, value=100) (Request ID: <id>)'),
    dict(name="chat top_logprobs 1000", path=CHAT, body=chat(logprobs=True, top_logprobs=1000),
         status=400, message='Message: Requested sample logprobs of 1000, which is greater than max allowed: 20 (parameter=logprobs, value=1000) (Request ID: <id>)'),
    dict(name="chat top_logprobs without logprobs", path=CHAT, body=chat(top_logprobs=5), status=400, message='Message: vllm.exceptions.VLLMValidationError: when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs) (Request ID: <id>)'),
    dict(name="seed 2**70", path=COMP, body=comp(seed=2**70), status=400, message="Invalid request format: Input should be less than or equal to 9223372036854775807 at ('body', 'seed')"),
    dict(name="stream is a string", path=COMP, body=comp(stream="yes"), status=200, message="<non-JSON body starting 'data: '>"),
    dict(name="unknown top-level field", path=COMP, body=comp(frobnicate=1), status=200, message=None),
    dict(name="consumption_rate negative", path=COMP, body=comp(consumption_rate=-1), status=400, message='Message: consumption_rate must be a positive, finite number (tokens/s) (Request ID: <id>)'),
    dict(name="consumption_rate 1e-9", path=COMP, body=comp(consumption_rate=1e-9), status=400,
         message='Message: consumption_rate must be at least 0.5 tokens/s (Request ID: <id>)'),
    dict(name="consumption_rate 100000 (over max_rate)", path=COMP, body=comp(consumption_rate=100000), status=400,
         message='Message: consumption_rate must be at most 10000 tokens/s (Request ID: <id>)'),
    dict(name="consumption_rate a string", path=COMP, body=comp(consumption_rate="fast"),
         status=400, message='Message: consumption_rate must be a number (tokens/s) (Request ID: <id>)'),
    dict(name="consumption_rate twice, different", path=COMP,
         body=comp(consumption_rate=10, vllm_xargs={"consumption_rate": 20}), status=400, message='Message: consumption_rate given twice with different values (10 and vllm_xargs 20) (Request ID: <id>)'),
    dict(name="tokenflow_continuation not a boolean", path=COMP, body=comp(stream=True, tokenflow_continuation="no"),
         status=400, message='tokenflow_continuation must be true or false, got "no"'),
    dict(name="JSON nested 100 levels deep", path=CHAT,
         raw=b'{"model": "MODEL", "messages": ' + b"[" * 99 + b"]" * 99 + b"}", status=400,
         message="JSON nested deeper than 64 levels"),
    dict(name="JSON nested 100,000 levels deep", path=COMP,
         raw=b'{"model": "MODEL", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", status=400,
         message="JSON nested deeper than 64 levels"),
    dict(name="n 16 x max_tokens 20000 (over max_request_tokens)", path=COMP, body=comp(n=16, max_tokens=20000),
         status=400, message="sequences x max_tokens must be at most 262144 tokens, got 16 x 20000 = 320000"),
    dict(name="tokenflow_rebalance not a boolean", path=COMP, body=comp(stream=True, tokenflow_rebalance=1),
         status=400, message="tokenflow_rebalance must be true or false, got 1"),
    dict(name="tokenflow_engine not a string", path=COMP, body=comp(tokenflow_engine=5), status=400,
         message="tokenflow_engine must be an engine id (a string), got 5"),
]

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_ID_IN_TEXT = re.compile(r"\b(cmpl|chatcmpl)-[0-9a-f-]+")


def normalize(message):
    """Mask what changes run to run (request and completion ids), drop Ray's
    ", Internal exception: ..." tail (the same text again) and cut to 300 chars."""
    if message is None:
        return None
    text = _UUID.sub("<id>", _ID_IN_TEXT.sub(r"\1-<id>", str(message)))
    return text.split(", Internal exception:")[0].strip()[:300]


def message_of(response):
    """The error message of a response: OpenAI shape, FastAPI `detail`, or text."""
    try:
        body = response.json()
    except ValueError:
        return f"<non-JSON body starting {response.text[:6]!r}>"
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return normalize(body["error"].get("message"))
        if "message" in body:
            return normalize(body["message"])
        if "detail" in body:
            return normalize(body["detail"])
        if "choices" in body:
            return None  # a normal answer
    return normalize(repr(body))


def _cell(text) -> str:
    text = "" if text is None else str(text)
    return text.replace("|", "\\|").replace("\n", " ")


def request_summary(case) -> str:
    method = case.get("method", "POST")
    if "raw" in case:
        raw = case["raw"]
        what = f"{len(raw)} raw bytes" if len(raw) > 120 else repr(raw)[2:-1]
    elif "body" in case:
        import json
        what = json.dumps(case["body"])
        if len(what) > 120:
            what = what[:110] + " …"
    else:
        what = ""
    headers = "".join(f" [{k}: {v}]" for k, v in (case.get("headers") or {}).items())
    return f"`{method} {case['path']}`{headers} {_cell(what)}"


def render_doc(cases=CASES) -> str:
    rows = "\n".join(
        f"| {i} | {_cell(c['name'])} | {request_summary(c)} | {c['status']} | {_cell(c['message'])} |"
        for i, c in enumerate(cases, 1))
    return DOC_HEAD + rows + "\n" + DOC_TAIL


DOC_HEAD = """# Reliability and security

<!-- Generated from tests/reliability_cases.py (python -m tests.reliability_cases);
     tests/test_reliability.py checks that this file, that list and the live app agree. -->

## Front door (tokenflow/serve/guard.py)

The OpenAI ingress runs one ASGI middleware outside everything else:

- **API keys** (optional). Set `TOKENFLOW_API_KEYS` (comma-separated) and/or
  `TOKENFLOW_API_KEYS_FILE` (one key per line, `#` comments) in the
  environment of the process that starts Ray (`make serve`, `serve run`),
  or in the app args' `env` (given to the ingress too). With keys
  configured, every route but `/health` (`/v1/...`, `/tokenize`,
  `/detokenize`, whatever the ingress serves, relative to its root_path)
  needs `Authorization: Bearer <key>`, else HTTP 401
  `{"error": {"type": "AuthenticationError", ...}}` with
  `WWW-Authenticate: Bearer`. Keys are compared as SHA-256 digests against
  every key, so the time taken tells neither which key nor its length. A
  configured key file that cannot be read or holds no key refuses all
  requests but `/health` (fail closed). Without either variable there is no
  authentication, and the ingress says so in its log ("authentication is
  OFF", naming an empty `TOKENFLOW_API_KEYS`). The readiness probes of
  `make serve` and `tokenflow bench-app` send a key from the same variables.
- **Admission bound**: `admission.max_ongoing_requests` (local.yaml 64,
  gpu.yaml 1024) POST requests may be in flight at once in each ingress
  replica (for the deployment: that times `ingress_replicas`). One more
  gets HTTP 429 `RateLimitError` with `Retry-After:
  <admission.retry_after_s, rounded up>` instead of waiting in an unbounded
  queue. If the engine deployment is given Ray Serve's
  `deployment_config.max_queued_requests`, Serve's BackPressureError (a 503
  in Ray 2.60) is rewritten to the same 429 + Retry-After. The slots in
  use show in `admission` of `GET /v1/tokenflow/engines`
  (`requests_in_flight`, `max_ongoing_requests`, `gets_in_flight`).
- **Body size and time**: bodies over `admission.max_body_bytes` (8 MiB)
  get HTTP 413 before they are parsed; a body not received within
  `admission.body_timeout_s` (30 s) gets 408 and gives its admission slot
  back.
- **Time limits and keepalives** (generation routes): a stream with nothing
  sent within `admission.first_token_timeout_s` (600 s), or any request
  past `admission.request_timeout_s` (3600 s), gets 504 JSON, or, once a
  stream has begun, an SSE error event `{"error": {"type": "TimeoutError",
  "code": 504, ...}}` and `[DONE]`; its task is cancelled, the ingress
  cancels its engine call (the engine aborts the request), and its slot is
  given back. A stream that has
  sent nothing for `admission.keepalive_s` (15 s), a paused reader's say,
  gets an SSE comment line `: keepalive` (clients skip comments). GETs in
  flight are bounded by `admission.max_ongoing_gets` (64; then 429),
  `/health` excepted.
- **Work per request**: `n` times the prompts of a batched completion at
  most `admission.max_n` (16), read as the handlers read them ("5", 5.0,
  JSON escapes); more gets 400; so do more than
  `admission.max_request_tokens` (262,144) tokens asked in all (sequences
  x `max_tokens`, or a chat's `max_completion_tokens`), and JSON nested
  deeper than `admission.max_json_depth` (64). Reading rates outside
  `tokenflow.min_rate`..`tokenflow.max_rate` get 400.
- **`GET /health`**: 200 `{"status": "ok", "engines": N}` while some engine
  can serve (its state reached the ingress's slack router in the last 5 s;
  an engine whose EngineCore died leaves at once); 503 when none can.

Tested without Serve in tests/test_guard.py (keys, 401s, the bound with a
tiny limit, 503→429, 413, 408, n, every route under any root_path, the
log line, keys from the app's env), and on the live app in
tests/test_reliability.py.

## Bad input

Every row was sent to the live tests' app (configs/local.yaml with engine
pinning and rebalancing on, tests/conftest.py; tiny model, 2 CPU
engines); after each row the app still answers a good request. `status` and
`message` are what came back (message: the JSON error's `message`, or
FastAPI's `detail`, ids masked, cut at 300 characters). `max_tokens: 2`
and model `MODEL` (the app's model id) unless shown otherwise.

| # | case | request | status | message |
| --- | --- | --- | --- | --- |
"""

DOC_TAIL = """
## Fixed while writing this table

- `Content-Type: text/plain` with a JSON body was HTTP 500 ("Object of
  type bytes is not JSON serializable" from the ingress's validation-error
  handler); the guard now answers 415.
- `n: 1000` was accepted (1000 sequences, 1000x the work of one request);
  the guard now refuses `n` above `admission.max_n` (16) with 400.
- Bodies of any size were read whole; now at most `admission.max_body_bytes`.

## Known gaps (accepted, kept as vLLM / Ray Serve LLM behave)

- **missing model** → 200: with one model served, Ray Serve LLM uses it.
- **unknown role** → 200: the chat template renders any role string.
- **stream is a string** → 200 streamed: pydantic coerces `"yes"` to true.
- **unknown top-level field** → 200: vLLM ignores unknown fields (it logs a
  warning); `consumption_rate` travels the same way, so this stays.
- Most 400 messages carry Ray's wrapper ("Message: ... (Request ID: ...),
  Internal exception: ..."), which repeats the internal exception class name.
- The admission bound counts requests per ingress replica, not cluster-wide.

## Engine replica failure (tokenflow/serve/failover.py)

When an engine replica dies under a request, the ingress sees Ray's
ActorDiedError (or ActorUnavailableError) on the handle's stream:

- **No token delivered yet** (every whole request, and streams before their
  first token): the ingress re-sends it, up to `admission.max_resends` (2)
  times; Serve has already dropped the dead replica, so the re-send goes to
  another one. Chunks without a token (a chat stream's role chunk) are held
  back until the first token, so a re-sent stream never shows two openings.
  With every re-send failed too: HTTP 503 `ServiceUnavailableError`.
  A request pinned to an engine (`tokenflow_engine`, where
  `admission.engine_pinning` allows it) is re-sent without its pin: the
  engine it named is the one lost. (The live kill tests pin each pair of
  their burst to an engine, so that the victim holds both kinds; left to
  the slack routing, one suite run found no engine holding both.)
- **Tokens already delivered**: the stream is continued on another engine
  (tokenflow/serve/continuation.py), up to `admission.max_continuations` (2)
  times. See "Stream continuation" below. A stream that cannot be continued
  ends with an SSE event
  `data: {"error": {"message": "the engine serving this request failed
  mid-stream; the response is incomplete", "type":
  "ServiceUnavailableError", "code": 503}}` and then `data: [DONE]`. The
  OpenAI Python client raises it as an APIError. Never a silent hang or a cut
  connection.
- The request router drops the dead engine at once (Serve's
  `on_replica_actor_died`), before its pushed state ages out; Serve restarts
  the replica and the router sends the new one work as soon as Serve lists it
  (a restarted engine is assumed as fast as its fastest twin until it shows
  its own speed, so it is not starved by a busy twin's proven capacity).
- The restarted engine takes over the dead one's slot of the node's shared
  host KV pool (tokenflow/serve/kv_pool.py): the node allocates no second copy. A
  slot is handed on only once its holder's pid is gone and no process maps
  its bytes any more.
- Counts: `replicas_lost` in `GET /v1/tokenflow/engines` (`resent`,
  `continued`, `finished`, `ended_mid_stream`, `gave_up`). `finished`: the
  engine was lost after the answer's last token and finish reason went out;
  the ingress sends the closing usage chunk itself, with no error event.

Test (tests/test_failover.py::test_replica_killed_during_a_burst, live
app): 16 pairs of a stream (reading at 20 tokens/s) and a whole request
with the same prompt, 2,000 tokens each, 4 of the pairs chats; SIGKILL the
replica process holding both kinds while no stream has ended. Every whole
request answers 200 with all 2,000 tokens. Every stream, the victim's
included, ends with `[DONE]`, no error event, one id, usage of 2,000
tokens, and exactly the text of its pair's whole answer (greedy): nothing
repeated or missing at the splice. No reader waits 30 s or more on an
empty buffer after the kill. The restarted replica receives requests again and holds the
victim's slot of the node's pool.
The re-send and continuation logic is also tested on scripted streams (role
chunk not repeated, bounded re-sends then 503, bounded continuations then
the error event, continuation off, other errors not swallowed).

## Engine core failure, replica alive (tokenflow/serve/failover.py)

On a GPU the common failure is vLLM's EngineCore process dying (a CUDA
error, an OOM) while the Serve replica lives on until its health check
fails. Until then the replica:

- refuses new work with `EngineLost`, and turns a failure of a request that
  has not delivered a token (a whole request, a stream before its first
  token) into `EngineLost` too: the ingress re-sends it like a request whose
  replica died (`admission.max_resends`);
- raises `EngineLost` in a stream that has delivered tokens too, so the
  ingress continues it elsewhere (or ends it with the same 503 error event
  as a lost replica, then `[DONE]`);
- leaves the slack routing at once: its agent stops pushing and removes the
  engine from the state board (an idle dead engine would otherwise look
  like the one with the most slack and draw every request);
- then Serve's health check (LLMServer.check_health) fails and Serve
  replaces the replica.

Test (tests/test_failover.py::test_engine_core_killed_with_its_replica_alive,
live app): 12 pairs of a stream and a whole request of 1,500 tokens, 3 of
them chats; SIGKILL the EngineCore of the replica holding both kinds (while
no stream has ended); its replica process stays alive; the engine leaves
`/v1/tokenflow/engines`; `/health` stays 200; 16 new requests meanwhile all
answer 200; every whole request answers 200 in full; every stream is
continued seamlessly as above; Serve replaces the replica.

Any other error on a stream after its first token (not an engine loss) ends
it with `{"error": {"type": "InternalServerError", "code": 500, ...}}` and
`[DONE]` instead of a cut connection (tests/test_failover.py, scripted
streams).

## Stream continuation (tokenflow/serve/continuation.py)

A stream whose engine is lost after its first token (replica death, or its
EngineCore's, or Serve stopping the replica: see the next section) is
finished by another engine, inside the same SSE stream:

- The ingress keeps, for each stream it can continue, the prompt's token
  ids and the ids sent so far (it asks vLLM for them with
  `return_token_ids` and takes them out of the chunks again unless the
  client asked for them too), and when each chunk went out, from which the
  reader's buffer follows (tokenflow/core/buffer.py, the model the
  scheduler uses).
- On the loss it sends a completions request to the slack routing, one
  push interval and a long poll later (so that it goes elsewhere): prompt =
  prompt ids + sent ids, `max_tokens` (and `min_tokens`) less what was
  sent, the same sampling fields, the same reading rate, and the reader's
  unread tokens and age in `vllm_xargs`. The engine's TokenFlow scheduler
  seeds that request's reader with the unread tokens, so it ranks like a
  released pause: ahead of newcomers once its buffer nears the resume
  level, behind them while it holds plenty (tests/test_policy.py, and
  tests/test_async_loop.py under vLLM's GPU loop).
- Its chunks are rewritten into the client's stream: the original id and
  created time, chat chunks for a chat stream, `usage` counting the whole
  answer (prompt tokens of the original prompt). A continuation lost too is
  continued again, up to `admission.max_continuations` (2) in all; then the
  error event. `0` switches continuation off for the app; a request's
  top-level `"tokenflow_continuation": false` switches it off for that
  stream (for a client that would rather have the error than a splice, as
  with a seeded sampler: see the limits below). Anything but a JSON boolean
  there gets 400.
- The negative control runs in the same burst as the replica kill
  (`test_replica_killed_during_a_burst`): half its completion streams opt
  out. Those the killed engine held end as streams did before
  continuation: the greedy answer's first part, the lost-engine error
  event, `[DONE]`, and one `ended_mid_stream` each in `replicas_lost`; the
  test fails if none of them was on the killed engine. The other streams
  of the same burst, on the same engine, are continued seamlessly.
- Counted as `continued` in `replicas_lost` of `GET /v1/tokenflow/engines`,
  and in Prometheus: `ray_tokenflow_engine_losses_total` by outcome, each
  splice's gap without tokens (`ray_tokenflow_continuation_gap_seconds`),
  the time readers waited on an empty buffer during splices and how many
  ran dry (`ray_tokenflow_continuation_stall_seconds_total`,
  `ray_tokenflow_continuation_stalls_total`); two panels on the overview
  dashboard.

Measured (this VM, 2 cores, the two live tests above, 2026-12-01, readers
at 20 tokens/s, the kill as soon as the victim had streams under way):
time readers waited on an empty buffer after the kill, per stream, 0 to
0.49 s with the replica killed (2.67 s over all 16 streams, the
survivor's included), 0 s with the engine core killed (12 streams). Three
later runs of the replica kill: up to 2.06 s per stream (a full
clean-clone suite run), 4-12 s for every stream, the survivor's own
included (a run of the module), and 0-0.44 s (the final run). On 2 cores
what this measures is mostly CPU: Serve starts the dead replica's
replacement at once, and its engine start takes both cores beside the
survivor, which has just taken on all of the victim's work. With only the
engine core killed no replacement starts during the burst: readers
waited at most 0.25 s in three runs, and 0.9-1.4 s (10 of 12 streams) in a
fourth. On a GPU node the survivor's steps do
not compete with an engine start for the same cores; not measured. The
tests print these figures (`pytest -s`) and fail above 30 s for any
stream (a continuation that waited for a timeout). Each continued stream's
text equalled the uninterrupted greedy answer.

Limits:
- Not continued (they end with the error event, as before): `n` > 1,
  `logprobs`, `echo`, stop strings (vLLM holds back text that may begin a
  stop string, so the text sent can lag the ids sent), tools, structured
  output or a non-text `response_format`, several prompts in one request.
- A sampled stream with a `seed` continues with a different random stream
  after the splice; presence and frequency penalties count only the
  continuation's own tokens as output (the sent ones are prompt there).
- A stream is continued from the ids it had sent: tokens the lost engine
  generated but the client never got are generated again (greedy: the same
  ones). So are sent ids whose text vLLM had held back (the last ids, when
  they end inside a UTF-8 character): primed with a prompt that ends so,
  vLLM's detokenizer begins its first chunk with the whole prompt's text.
  The engine replica that takes the continuation cuts such ids off its
  prompt with the engine's own tokenizer; the ingress reads the cut from
  the prompt ids the continuation reports. (Found by the live tests twice:
  first after an id sent with empty text, then after a chunk of two ids
  whose second was held back, which a chunk's text cannot show.)
- A client that asked for `return_token_ids` gets the continuation's ids,
  and no second `prompt_token_ids`.
- Chat streams now carry a chunk for every token, one whose text is still
  being decoded included (empty `delta`), as vLLM sends them when asked for
  token ids.
- Moving streams off a busy engine: the section after the next.

## Redeploys and scale-downs: streams handed over (tokenflow/serve/llm_server.py)

When Serve stops an engine replica (a new config version, fewer replicas),
it drains the replica: it waits for the replica's requests to end, up to
`graceful_shutdown_timeout_s` (20 s by default), then kills it, cutting what
is left. A stream of a slow reader can take minutes. So the replica hands
its streams over instead:

- It reads Serve's own flag on the replica (`Replica._shutting_down`, set
  when the graceful shutdown begins; tokenflow/serve/ray_private.py, a
  private name to re-check on a Ray upgrade). After the chunk in hand, each
  of its streams raises `EngineLost`, and the ingress continues it on
  another engine, as after a failure ("Stream continuation" above). A stream
  its engine holds paused sends no chunk, so it leaves when it runs again
  (the policy resumes it before its reader runs dry).
- A request that reaches the replica while it stops (a router that has not
  heard yet) goes back to the ingress and is re-sent elsewhere.
- Its agent takes the engine out of the slack routing at once, so the
  continuations and new requests go to the other engines.
- Whole requests are not handed over: they finish within the drain. So the
  engines' `graceful_shutdown_timeout_s` is `admission.request_timeout_s`
  too (a day when that is null; a value in `deployment_config` wins;
  tokenflow/serve/app.py, `build_llm_config`), as long as the guard lets
  a request run. With Serve's 20 s, one clean-clone run (2026-12-02) saw
  the replica killed under a whole request of 1,500 tokens: the ingress
  re-sent it (no token had gone out), so the client got its answer late
  and the loss counted as a `failure`. Streams do not hold the drain open:
  they leave at their next chunk.
- Counted by cause: `replicas_lost_by_cause` in `GET /v1/tokenflow/engines`
  (`failure`, `shutdown`), and the `cause` label of
  `ray_tokenflow_engine_losses_total` (the overview's "Engine losses" panel
  shows both).

Test (tests/test_failover.py::test_a_scale_down_through_serve_hands_its_streams_over,
live app): 8 pairs of a stream and a whole request of 1,500 tokens, 2 of
them chats. Once every stream has tokens (the router has spread them over
both engines; read from the client's side, since the ingress answers polls
late during such a burst on 2 cores), the app's own config is
deployed again with a `deployments` override of one engine replica
(`num_replicas: 1`), through Serve's REST API on the Ray dashboard, as
`serve deploy` sends it. Serve's controller picks a replica and stops it.
Every stream is continued seamlessly, as in the failure tests; the losses
count as `shutdown`, none as `failure`; no reader waits 30 s or more on an
empty buffer after the stop. The redeploy test below brings the second
engine back.

The test sends the PUT itself, with the cluster's token: Ray 2.60 turns
token auth on for the local cluster that `serve run` starts, and keeps
the token in `~/.ray/auth_token`. An operator's `serve deploy` against
`make serve`'s app needs `RAY_AUTH_MODE=token` in its environment to send
that token. On 2 busy cores the `serve` command took 40 s to start and
reach the controller, and the burst was over by then.

Measured (this VM, 2026-12-02 06:32 UTC, readers at 20 tokens/s): the
controller stopped the replica 0.16 s after the PUT; its streams left it
within 0.1 s; readers waited 0 s on an empty buffer; the replica was
stopped 2.1 s after the stop began. Earlier runs of the test it replaces,
which called the replica's `perform_graceful_shutdown` itself (2026-12-01,
three runs): readers waited at most 0.98, 0.11 and 0.09 s per stream; the
drain took 18.3, 28.6 and 11.3 s, the whole requests in hand. In an
earlier version, which left the handed-over streams' requests running in
the stopping engine until the replica died, the drain took 50.7 s: the
replica now aborts each one as it hands it over.

A redeploy that changes the app's `args` (any of them) is a new code
version of the whole app: Serve replaces every replica, the ingress's too.
- The engines roll one at a time: Serve stops an old one (which hands its
  streams over as above) and starts a new one, or starts one first when
  the deployment is short of its target.
- The old ingress drains: it takes no new request and relays the streams
  it holds to their end. Serve kills a draining replica after its
  `graceful_shutdown_timeout_s`, 20 s by default, which would cut any
  stream still running then; TokenFlow sets the ingress's to
  `admission.request_timeout_s` (one day when that is null), the longest
  the guard lets a request run (tokenflow/serve/app.py,
  `ingress_deployment_config`). New requests wait in Serve's proxy until
  the new ingress runs.
- Serve's controller imports the request router's module to validate a
  config that overrides a deployment (the scale-down above). That module
  used to import vLLM through Serve LLM's OpenAI models, and the
  controller applied the override only after that import: 8 s on an idle
  VM, about 20 s during a burst, by which time the test's streams had
  ended. Those names are now imported on first use
  (tokenflow/serve/ray_private.py); the router's module imports in 1 s.

Test (tests/test_failover.py::test_a_redeploy_that_changes_the_args_cuts_no_stream,
live app, run right after the scale-down, so from one engine): three
pairs of a stream and a whole request of 500 tokens, then the config with
`admission.request_timeout_s` halved and `router.horizon_s` changed,
through Serve's REST API; then one more pair every 1.5 s until two
engines of the new version run, every fourth pair a chat. Every stream
completes with the greedy answer's text, one id, the answer's `usage` and
`[DONE]`; no engine and no ingress replica of the old version is left;
the new ingress counts the streams the last old engine handed over
(`shutdown` at least 1, `failure` 0); the new version routes through a
state board of its own router settings (the old one removes itself once
no engine pushes to it: tokenflow/serve/routing/board.py). During the
rollout the old ingress's router knows only the old engines (its board's)
and sends continuations to those still running, then, once none is left
on its board, by Serve's default choice to the new ones. Measured (this
VM, 2026-12-02): 70 pairs over a rollout of 120 s, readers waited at most
0.12 s on an empty buffer, 0.32 s in all (10:09 UTC); with only the
request timeout changed, 65 pairs over 115 s, at most 1.23 s, 1.79 s in
all (09:27 UTC). The test does not show a stream outliving Serve's 20 s default
through the draining ingress: the streams the old ingress held ended
sooner than that. Run once with the ingress's timeout set back to 20 s,
it passed as well (70 pairs, 125 s), so it does not guard that setting;
tests/test_settings.py checks the setting itself.

## Rebalancing: paused streams moved off a busy engine (tokenflow/serve/routing/rebalance.py)

The slack router places a request where slack is largest when it arrives;
it cannot know how long the answer will be, so long answers can pile onto
one engine while short ones leave another idle. The busy engine then
time-shares its slots among more readers than it can serve at once, and
its readers stall in turn; no later request fixes that. Each engine
therefore checks itself every `router.rebalance_interval_s` (1 s):

- Paused streams mean it is short of room: TokenFlow's policy pauses a
  reader only when a newcomer needs its slot or the engine cannot keep up
  with every reader at once. A stream counts as paused when it has had no
  token for 0.5 s.
- While it holds paused streams whose readers still have at least
  `rebalance_min_buffer_s` (0.5 s) of text (the time for a first token
  elsewhere: a push, a long poll and a prefill), it reads the state
  boards' head (the engines with the most slack) and moves them, each to
  the least loaded peer that has nobody queued, a free slot (its `slots`,
  vLLM's `max_num_seqs`, less its load) and spare decode rate for the
  reader, for as long as that leaves it more loaded than that peer.
  Streams only go downhill, so two engines never trade them back and
  forth.
- Most buffered seconds first: a move costs its reader a gap (the
  continuation's prefill on the peer, beside the others moved in the same
  round), so it goes to the readers with the most text in hand; those
  about to run dry stay, and their engine, less loaded now, resumes them
  in place. The first version moved the soonest-dry first and levelled by
  load alone, without the slot bound; it raised the readers' total stall
  (the measurement below).
- The engine names the peer, and the continuation goes there: the
  router's own ranking counts decode rate, not slots, and sent moved
  streams straight back to the busy engine in the first live runs.
- A move is a continuation: the replica interrupts the stream while it
  waits for its next chunk (it cancels that wait, which ends the engine
  request) and ends its side of the stream with an SSE comment the
  ingress reads as "moved" (a normal end for Serve: no error logged or
  counted); the ingress continues it on the peer named. The reader sees
  one stream, the same text.
- Only streams the ingress could continue may move: the ingress marks
  them (`vllm_xargs.tokenflow_movable`) while they have a continuation
  left, so a move never ends a stream with an error event. A stream that
  asks to stay (`"tokenflow_rebalance": false`; it is still continued if
  its engine is lost), opted out of continuation or cannot be continued
  (see the limits above) stays. A move uses one of the stream's
  `max_continuations`. Anything but a JSON boolean in
  `tokenflow_rebalance` gets 400.
- Counted as `continued` with cause `rebalance` in `replicas_lost_by_cause`
  of `GET /v1/tokenflow/engines` and in `ray_tokenflow_engine_losses_total`
  (the overview dashboard's panel of losses by outcome and cause); a moved
  stream ends on its first engine with status `moved` in
  `ray_tokenflow_requests_finished_total`. `router.rebalance` switches it
  on: off by default (see the measurement below), also in
  configs/local.yaml; the live tests' app (tests/conftest.py) and
  `tokenflow bench-rebalance` switch it on.

Tests: tests/test_rebalance.py: the policy on engine states (downhill
levelling over one or more peers, the best stocked readers first, none
under the buffer floor, peers' free slots and spare rate as the bounds,
peers with a queue skipped, a reader faster than the engine's best step rate
counted at that rate); on a real asyncio stream, a paused movable stream interrupted while
it waits, its engine request closed, the task that drove it not left
cancelled, a stream that may not move left alone; the ingress continuing
a move and counting it as a rebalance. Live
(`test_a_skewed_burst_moves_paused_streams_to_the_idle_engine`): 60
streams pinned to one engine (`tokenflow_engine`, allowed by
`admission.engine_pinning`, on in the tests' app), the other idle;
first asking to stay (none may move: none moves, the negative control),
then movable, readers at 10 tokens/s: streams move, the idle engine receives them,
and every stream reads exactly the first round's greedy text, one id, the
whole usage and `[DONE]`.

Measured with and without (`tokenflow bench-rebalance`, docs/BENCHMARKS.md,
"Rebalancing"; this 2-core VM, a burst of slow readers pinned to one
engine needing twice its share of the capacity, rounds in turns, three
runs): with moves, effective throughput 1.32x-1.97x in all seven pairs of
rounds, P99 TTFT lower in five of seven, raw throughput about unchanged,
but the readers' total stall higher (in all three pairs of the last run:
a miss). The current order and slot bound, one run of three pairs:
effective throughput 1.22x-1.70x, total stall higher in two pairs of
three (6.3x and 24.6x; 0.91x in the other). Hence off by default. On two cores the idle engine adds little
capacity, since it competes with the busy one for the same cores, and
each move pays a prefill on the peer; on GPUs each engine has its own
device, not measured. In the live test's burst, two runs: 28 of 60 streams moved each
time; total stall 21 s and 9 s against 40 s and 23 s asking to stay;
longest first token 1.4 s and 1.7 s against 5.7 s and 5.2 s.

Limits:
- A moved stream is restarted on the peer by a prefill of its prompt and
  the tokens sent (its KV is not carried over); a sampled stream continues
  with another random stream there, as after a failure.
- The peers' spare decode rate is their best rate shown less what their
  readers need, the ranking's estimate, and their free slots are counted
  from their last push: KV is not counted, so a peer short of KV may
  still take streams; it then pauses some in turn (and moves them on only
  downhill).
- Moves are decided per engine, each from its own view and the boards'
  head; engines do not agree among themselves, so two busy engines may
  send to one peer in the same round.

## Node KV pools: life and size (tokenflow/serve/kv_pool.py)

- A node's pool actor is named after the node and a digest of the
  `kv_pool` settings: a redeploy with other settings gets its own pool
  instead of silently reusing the old one.
- It lives while engines use it (hold a slot, or report within
  `engine_ttl_s`), and removes itself once none has for
  `kv_pool.idle_exit_s` (60 s): after `serve delete`, its memory is freed.
  An engine that finds its pool exiting waits and creates a new one.
- With `size_bytes` unset, the pool is `ram_fraction` of the node's memory:
  the container's memory limit (cgroup v2 `memory.max`, v1
  `memory.limit_in_bytes`) where that is lower than the host's RAM.

Tests: tests/test_host_shm.py::test_a_pool_lives_while_engines_use_it_and_settings_get_their_own
(real Ray, an engine stood in by a process holding a slot),
tests/test_host_shm.py::test_pool_default_size_stays_within_a_containers_memory_limit.

## Hardening: each case and its test

| case | now | test |
| --- | --- | --- |
| `make serve` with API keys never came up | readiness probes send a key from the same variables | tests/test_guard.py::test_readiness_probe_passes_the_guard_when_keys_are_on; live (the launcher's probe against the keys-on cluster app: refused without the variable, ready with it): tests/test_cluster.py::test_with_keys_on_every_route_but_health_needs_one |
| routes outside `/v1/`, other root_path | every route but `/health` guarded | tests/test_guard.py::test_every_route_but_health_needs_the_key_under_any_root_path; live (keys in the app's env, Serve, engines: `/v1/completions`, `/tokenize`, `/v1/models`, `/v1/tokenflow/engines` 401 without or with a wrong key, past the guard with it; `/health` open): tests/test_cluster.py::test_with_keys_on_every_route_but_health_needs_one |
| `n` as "1000", 1000.0, escaped key; prompt lists | 400 past `max_n` sequences | rows 30-32 above (tests/test_reliability.py), tests/test_guard.py::test_n_over_max_gets_400_on_generation_routes_only |
| total tokens one request asks for unbounded; deeply nested JSON | 400 past `max_request_tokens` (sequences x max_tokens, 262,144) or `max_json_depth` (64 levels; a depth that would overflow the parser too) | rows 44-46 above (tests/test_reliability.py), tests/test_guard.py::test_total_tokens_and_json_depth_are_bounded |
| slow bodies holding admission slots | 408 after `body_timeout_s`, slot back | tests/test_guard.py::test_slow_body_gets_408_and_frees_its_slot; live (Serve, engines, every slot held by a slow body: a good client gets 429, each slow sender 408, then the good client 200): tests/test_cluster.py::test_slow_bodies_get_408_and_give_their_slots_back |
| reading rate 1e-9 or 100,000 tokens/s | 400 outside `min_rate`..`max_rate` | rows 40-41 above (tests/test_reliability.py) |
| EngineCore death, replica alive | re-sent / continued on another engine; out of routing at once | tests/test_failover.py::test_engine_core_killed_with_its_replica_alive |
| other mid-stream exceptions | 500 error event and `[DONE]` | tests/test_failover.py::test_other_errors_after_the_first_token_end_the_stream_with_an_error_event |
| KV pool actor outliving the app; old pool on redeploy | removes itself when unused; one per settings | tests/test_host_shm.py::test_a_pool_lives_while_engines_use_it_and_settings_get_their_own |
| pool size from host RAM in a container | within the cgroup limit | tests/test_host_shm.py::test_pool_default_size_stays_within_a_containers_memory_limit |
| vLLM's files left in /dev/shm by each stop | removed at stop once unmapped | tests/test_bench.py::test_bench_app_end_to_end_all_policies (three apps started and stopped) |
| empty `TOKENFLOW_API_KEYS` silently turns auth off | log line | tests/test_guard.py::test_auth_off_is_said_in_the_log; live (the line in the keys-off app's `serve run` log): tests/test_reliability.py::test_front_door_is_wired_with_keys_off |
| keys in the app's `env` never reached the ingress | given to the ingress | tests/test_guard.py::test_keys_in_the_app_env_reach_the_ingress; live: the cluster app of tests/test_cluster.py runs with keys on (every test there sends one) |
| key comparison leaks the key's length | SHA-256 digests compared | tests/test_guard.py::test_bad_or_missing_key_gets_401 |
| `/health` "ok" whatever the engines' state | 503 when no engine can serve | tests/test_failover.py::test_engine_core_killed_with_its_replica_alive, tests/test_reliability.py::test_front_door_is_wired_with_keys_off |
| `/v1/tokenflow/engines` open to anyone | behind the keys like every route | tests/test_guard.py::test_every_route_but_health_needs_the_key_under_any_root_path, tests/test_cluster.py::test_with_keys_on_every_route_but_health_needs_one (live) |
| a re-send after ActorUnavailableError did not cancel the first attempt | the ingress records each attempt's engine call (a wrapper around Serve LLM's handle) and cancels it (`DeploymentResponse.cancel`, best effort) before re-sending | tests/test_failover.py::test_a_resend_cancels_the_attempt_it_abandons (Serve's handle stood in; live re-sends after a killed replica or core go through the same path in tests/test_failover.py) |
| no time limit on the first token or on a whole request | `first_token_timeout_s` (600 s) and `request_timeout_s` (3600 s): 504 JSON, or an SSE error event and `[DONE]` once a stream has begun; the request's task is cancelled, the ingress cancels its engine call (Serve does not carry a cancel from inside a replica on: found by the live test) and its admission slot is given back | tests/test_guard.py::test_no_first_token_in_time_gets_504_and_the_work_is_cancelled, tests/test_guard.py::test_a_request_over_its_time_limit_ends_cleanly_and_is_cancelled (the real guard on FastAPI streaming apps); live, `request_timeout_s` 6 s on a whole answer and a stream of 8 x 1,000 tokens: 504, error event and `[DONE]`, both engines idle within seconds: tests/test_cluster.py::test_requests_past_their_time_limit_end_cleanly_and_leave_the_engines; live, `first_token_timeout_s` 4 s on a stream queued behind engines full to Serve's `max_ongoing_requests`: 504 JSON at 4 s, and it never runs once the slots free: tests/test_cluster.py::test_a_stream_with_no_token_in_time_gets_504_and_never_runs |
| a paused stream sends nothing for seconds (idle-timeout proxies cut it) | `: keepalive` SSE comment after `keepalive_s` (15 s) of silence; none on a busy stream | tests/test_guard.py::test_a_quiet_stream_gets_keepalive_comments_and_a_busy_one_none; live (keepalive 30 ms, shorter than Serve LLM's 50 ms stream batches: comments between batches; the `openai` client reads such a stream unharmed): tests/test_cluster.py::test_requests_past_their_time_limit_end_cleanly_and_leave_the_engines |
| GETs not bounded | `max_ongoing_gets` (64) in flight, then 429; `/health` exempt | tests/test_guard.py::test_gets_in_flight_are_bounded_but_health_is_not; live (bound 4, 32 GETs at once): tests/test_cluster.py::test_gets_in_flight_are_bounded_and_health_is_not |

## Overload

- **Flood past the bound** (tests/test_overload.py, live app, bound 64):
  112 streams of 400 tokens at once: **64 served in full, 48 refused** with
  429, `Retry-After` and a JSON error; none cut, none hung; the app answers
  normally after. (21.7 s, 2026-11-29.)
- TokenFlow's FCFS fallback (required rates above `overload_factor` x
  the measured capacity; off unless that is set) is
  counted in `ray_tokenflow_fallbacks_total` (Prometheus) and in each
  engine's scheduler summary.

## Soak: 2,000 requests (tokenflow/tools/loadtest/soak.py)

Command: `make serve` in one shell, then
`.venv/bin/tokenflow soak --requests 2000 --burst 48 --warmup-requests 200 --out soak.json`
(the test tests/test_overload.py runs 600 requests, the same otherwise,
against its app and holds every process to 10%). Warm-up: a sweep of step sizes (800 one-token
requests, prompts of 1-400 words, 8 at a time; see below why), then the
first 200 requests. Then bursts of 48 at once (under the bound of 64), each
request one of streamed/whole completions/chat in turn, greedy with
`ignore_eos`, 8-48 tokens, reader rates 5-40 tokens/s. Resident memory of
every Ray and vLLM process on the machine is read after the warm-up and
after every later burst.

Measured on the 2-core machine, 2026-11-29 20:00 UTC (`make serve`, then the
command above): **2,000 ok, 0 errors, 0 lost** (and 800 of 800 in the sweep),
5 min 27 s in all. Worst growth over warm-up, every process: **3.7%** (the
GCS, 53.6 -> 55.6 MiB; raylet 3.7%, 35.6 -> 36.5 MiB; proxy 1.4%); vLLM's
worker processes **0.0% and 0.04%** (1204.0 -> 1204.1 and 1186.3 -> 1186.7
MiB), engine-core processes 0.3%, engine replicas 0.6%. Routing over 2,002
decisions (an earlier soak, same code path): 0.029 ms P50, 0.34 ms P99
inside the router; the chosen engine's state was 58 ms old at P50, 166 ms
at P99, 274 ms at most.

Found and fixed by the soak:
- The GCS grew 46% (73 -> 107 MiB) in 2,000 requests: every state push and
  long poll (tens a second) left a task event in the GCS. Those methods now
  keep no task events (`@ray.method(enable_task_events=False)`).
- The host KV pool was allocated zeroed but untouched, so each engine's
  worker grew by the pool's size as blocks were first used. It is now
  committed at start (today: the node's KV pool actor commits the node's
  shared pool file; each worker maps its slot with every page faulted in).
- vLLM's worker processes grew 10-14% over 2,000 requests, and kept
  creeping. Two causes, both now handled:
  - glibc's malloc fragments under vLLM's CPU engine. The app now preloads
    tcmalloc into the engines on CPU (`make` installs
    `libtcmalloc-minimal4`; vLLM's CPU backend asks for it). With it alone
    the workers grew 3.7-4.5%, then 7% with the shared pool in place.
  - The rest is bounded caching, not a leak: vLLM's CPU engine caches
    compiled matmul kernels (oneDNN primitives, a bounded LRU per linear
    layer) for every new step size (tokens in a step). In-process
    measurement, one request at a time: 757.8 MiB after 200 requests of one
    size, unchanged; +330 MiB over the first 300 new sizes; then flat, to
    within 5 MiB, over 400 repeated sizes, 400 further new sizes and 300
    more requests. Bursts reach new step sizes slowly, which looked like a
    creep. The sweep in the warm-up fills these caches first; after it the
    workers are flat (above).
"""


if __name__ == "__main__":
    DOC.write_text(render_doc())
    print(f"wrote {DOC}")
