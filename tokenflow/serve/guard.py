"""The ingress's front door: optional API keys, a bounded admission count and
a request-body size limit, as one pure ASGI middleware.

Installed by tokenflow/serve/app.py on the OpenAI ingress's FastAPI app, outside
every other middleware, so a refused request never reaches the OpenAI
handlers, the request router or an engine.

API keys (off unless configured; never in the YAML):
  TOKENFLOW_API_KEYS       comma-separated keys
  TOKENFLOW_API_KEYS_FILE  a file with one key per line ('#' lines and blank
                           lines are skipped)
Both are read in the ingress replica when it builds its middleware, i.e. from
the environment Ray gives the replica (the environment of the process that
started Ray, or the app args' `env`, which tokenflow/serve/app.py gives
the ingress too). With at least one key, every request
(any route: /v1/..., /tokenize, /detokenize, whatever the ingress serves)
needs `Authorization: Bearer <key>`; otherwise HTTP 401. Only /health stays
open. A configured but unreadable or empty key file refuses all traffic
(fail closed) rather than silently serving without auth. Paths are taken
relative to the app's root_path, so a route_prefix other than / is guarded
the same way.

Admission (app arg `admission`, AdmissionSettings, every field described
there): a bound on POSTs in flight per ingress replica (beyond: 429 +
Retry-After), a body size limit (413), a time limit on receiving the body
(408: a slow sender must not hold an admission slot), and a bound on the
sequences one generation request asks for, `n` times the prompts of a
batched completion (400; vLLM itself accepts any n, one sequence each).
`n` is read as the OpenAI handlers will read it (JSON escapes, "5", 5.0).
`tokenflow_continuation` (a stream's opt-out of continuation) must be a
JSON boolean (else 400).
Generation requests run under time limits (first token, whole request:
504, or an SSE error event and [DONE] once a stream has begun; the work is
cancelled) and a quiet stream gets SSE keepalive comments (TimedRequest).
GETs in flight are bounded too (429), /health excepted.
A POST whose Content-Type is neither JSON nor a form gets HTTP 415
(FastAPI would otherwise hand the handler bytes and answer 500).
Ray Serve's own `max_queued_requests` on the engine deployment makes the
ingress's handle raise BackPressureError, which reaches clients as HTTP 503;
this middleware rewrites such a 503 to 429 with Retry-After as well.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import weakref
from typing import Iterable, Optional

from pydantic import Field

from tokenflow.core.config import CONTINUATION_KEY, PIN_KEY, REBALANCE_KEY
from tokenflow.core.settings import Amount, Count, Positive, Settings
from tokenflow.serve.failover import lost_event

logger = logging.getLogger("ray.serve")

KEYS_ENV = "TOKENFLOW_API_KEYS"
KEYS_FILE_ENV = "TOKENFLOW_API_KEYS_FILE"
OPEN_PATHS = ("/health",)  # answered without a key: liveness only
# JSON routes where `n` (and a completion's prompt list) multiply the work.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
ACCEPTED_TYPES = ("application/json", "multipart/form-data", "application/x-www-form-urlencoded")


class AdmissionSettings(Settings):
    """The `admission:` block of the app args: the ingress's front door.
    API keys are never here: they come only from the environment
    (TOKENFLOW_API_KEYS or TOKENFLOW_API_KEYS_FILE)."""

    block = "admission"

    max_ongoing_requests: Count | None = Field(256, description="POSTs to /v1/ in flight per ingress replica; "
                                                                "beyond it: 429 with Retry-After. null: no bound.")
    retry_after_s: Positive = Field(1.0, description="The Retry-After of a 429 (s, rounded up).")
    max_body_bytes: Count = Field(8 * 2**20, description="Larger request bodies get 413.")
    max_n: Count = Field(16, description="Most sequences one generation request may ask for: `n` times the "
                                         "prompts of a batched completion; more gets 400.")
    body_timeout_s: Positive = Field(30.0, description="Time to receive a request's whole body; a slower sender "
                                                       "gets 408 and gives its admission slot back.")
    max_request_tokens: Count | None = Field(262144, description="Most tokens one generation request may ask "
                                                                 "for: sequences (n x prompts) x max_tokens "
                                                                 "(chat: max_completion_tokens if given); more gets "
                                                                 "400. null: no bound.")
    max_json_depth: Count = Field(64, description="Deepest nesting of arrays and objects in a JSON body; deeper "
                                                  "gets 400.")
    first_token_timeout_s: Positive | None = Field(600.0, description="A streaming generation request with nothing "
                                                                     "sent within this time (s) is ended with 504 "
                                                                     "and its engine request cancelled; null: no "
                                                                     "limit.")
    request_timeout_s: Positive | None = Field(3600.0, description="Longest a generation request may take in all "
                                                                   "(s), a stream included: then 504, or an SSE "
                                                                   "error event and [DONE] once the stream has "
                                                                   "begun; its engine request is cancelled. null: "
                                                                   "no limit.")
    keepalive_s: Positive | None = Field(15.0, description="A stream that has sent nothing for this long (s), "
                                                           "a paused reader's say, gets an SSE comment line "
                                                           "(': keepalive'), so idle-timeout proxies keep it "
                                                           "open; null: never.")
    max_ongoing_gets: Count | None = Field(64, description="GETs in flight per ingress replica (all but "
                                                           "/health); beyond it: 429. null: no bound.")
    max_resends: Amount = Field(2, description="Re-sends of a request whose engine replica died before its first "
                                               "token (tokenflow/serve/failover.py).")
    max_continuations: Amount = Field(2, description="Times a stream whose engine is lost after its first token "
                                                     "is continued on another engine (tokenflow/serve/"
                                                     "continuation.py); then, or with 0, it ends with an SSE "
                                                     "error event.")
    engine_pinning: bool = Field(False, description="Honour a request's `tokenflow_engine` (an engine id from "
                                                    "GET /v1/tokenflow/engines): it goes to that engine while "
                                                    "that engine serves, else where the router ranks. For "
                                                    "operators testing one engine and for benches; off, the "
                                                    "field gets 400.")


class KeyFileError(RuntimeError):
    pass


def load_api_keys(environ=None) -> Optional[frozenset]:
    """The configured keys, or None when auth is off.

    Raises KeyFileError when TOKENFLOW_API_KEYS_FILE is set but cannot be read
    or holds no key (the caller fails closed)."""
    environ = os.environ if environ is None else environ
    keys = set()
    configured = False
    raw = environ.get(KEYS_ENV)
    if raw is not None and raw.strip():
        configured = True
        keys.update(k.strip() for k in raw.split(",") if k.strip())
    path = environ.get(KEYS_FILE_ENV)
    if path:
        configured = True
        try:
            with open(path, encoding="utf-8") as f:
                keys.update(line.strip() for line in f
                            if line.strip() and not line.strip().startswith("#"))
        except OSError as e:
            raise KeyFileError(f"{KEYS_FILE_ENV}={path!r} cannot be read: {e}") from None
        if not keys:
            raise KeyFileError(f"{KEYS_FILE_ENV}={path!r} holds no key")
    return frozenset(keys) if configured else None


def error_body(message: str, type_: str, code: int, param: Optional[str] = None) -> bytes:
    # The shape OpenAI clients parse: {"error": {"message", "type", "param", "code"}}
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(send, status: int, message: str, type_: str,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(message, type_, status)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def relative_path(scope) -> str:
    """The route as the ingress's handlers see it, without the root_path
    (a route_prefix other than /)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


def as_count(value) -> Optional[int]:
    """An int as pydantic's lax mode reads one ("5", 5.0, 5), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def nested_deeper(doc, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (the top one is 1)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def sequences(path: str, body: dict) -> int:
    """How many sequences a generation request makes the engine run."""
    n = as_count(body.get("n", 1))
    n = 1 if n is None else n  # not a number: the handlers answer with their own 400
    prompt = body.get("prompt") if path == "/v1/completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        n *= len(prompt)  # a batch: one completion per prompt
    return n


# The guards of this process (one per app the ingress builds), so that
# GET /v1/tokenflow/engines can show the admission slots in use: read when
# asked, nothing counted per request beyond the slot itself.
_GUARDS: "weakref.WeakSet[TokenFlowGuard]" = weakref.WeakSet()


def admission_view() -> dict:
    """POSTs and GETs in flight in this process's guards, and their bounds."""
    guards = list(_GUARDS)
    bounds = [g.settings.max_ongoing_requests for g in guards]  # each guard bounds its own
    return {"requests_in_flight": sum(g.ongoing for g in guards),
            "max_ongoing_requests": None if not bounds or None in bounds else sum(bounds),
            "gets_in_flight": sum(g.ongoing_gets for g in guards)}


class TokenFlowGuard:
    """Pure ASGI middleware (no response buffering, streams pass through)."""

    def __init__(self, app, admission: Optional[dict] = None, api_keys: Optional[Iterable[str]] = None,
                 environ=None):
        self.app = app
        self.settings = AdmissionSettings.from_dict(admission)
        self.key_error: Optional[str] = None
        if api_keys is not None:
            self.keys = frozenset(api_keys)
        else:
            try:
                self.keys = load_api_keys(environ)
            except KeyFileError as e:
                self.keys, self.key_error = frozenset(), str(e)
        self._key_digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in self.keys or ()]
        if self.keys is None:
            empty = KEYS_ENV in (environ if environ is not None else os.environ)
            logger.warning("TokenFlow guard: authentication is OFF: %s", (
                f"{KEYS_ENV} is set but holds no key" if empty and api_keys is None
                else f"neither {KEYS_ENV} nor {KEYS_FILE_ENV} is set"))
        elif self.key_error:
            logger.error("TokenFlow guard: %s; every request but /health gets 401", self.key_error)
        self.ongoing = 0
        self.ongoing_gets = 0
        st = self.settings
        self._timed = any(x is not None for x in (st.first_token_timeout_s, st.request_timeout_s, st.keepalive_s))
        retry = str(max(1, math.ceil(self.settings.retry_after_s))).encode()
        self._retry_header = (b"retry-after", retry)
        _GUARDS.add(self)

    @property
    def auth_enabled(self) -> bool:
        return self.keys is not None

    def _authorized(self, scope) -> bool:
        if self.keys is None:
            return True
        if not self.keys:  # fail closed: a key file was configured but unusable
            return False
        header = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        # Digests of equal length, compared against every key: the time
        # taken tells neither which key nor how long the keys are.
        token_d = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        ok = False
        for key_d in self._key_digests:
            ok |= hmac.compare_digest(token_d, key_d)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = relative_path(scope)
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            msg = ("API key configuration error on the server" if self.key_error
                   else "Missing or invalid API key: send 'Authorization: Bearer <key>'")
            return await send_error(send, 401, msg, "AuthenticationError",
                                    [(b"www-authenticate", b"Bearer")])
        if scope.get("method") != "POST":
            return await self._bounded_get(scope, receive, send)

        limit = self.settings.max_body_bytes
        ctype = ""
        for name, value in scope.get("headers") or ():
            if name == b"content-type":
                ctype = value.decode("latin-1").split(";")[0].strip().lower()
                if ctype and not (ctype in ACCEPTED_TYPES or ctype.endswith("+json")):
                    return await send_error(send, 415, f"Unsupported Content-Type {ctype!r}: send application/json",
                                            "UnsupportedMediaTypeError")
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    return await send_error(send, 413, f"Request body larger than {limit} bytes",
                                            "RequestTooLargeError")
        # Admission before reading the body: an overloaded server reads nothing.
        cap = self.settings.max_ongoing_requests
        if cap is not None and self.ongoing >= cap:
            return await send_error(
                send, 429, f"Server overloaded: {self.ongoing} requests in flight (limit {cap}); retry later",
                "RateLimitError", [self._retry_header])
        self.ongoing += 1
        try:
            try:
                body = await asyncio.wait_for(self._read_body(receive, limit), self.settings.body_timeout_s)
            except _TooLarge:
                return await send_error(send, 413, f"Request body larger than {limit} bytes",
                                        "RequestTooLargeError")
            except asyncio.TimeoutError:
                return await send_error(send, 408, f"Request body not received within "
                                                   f"{self.settings.body_timeout_s:g} s", "RequestTimeoutError")
            if body is None:  # client went away while sending
                return
            doc, problem = self._parse(path, body, ctype)
            if problem is None:
                problem = self._check_work(path, doc) or self._check_options(doc)
            if problem is not None:
                return await send_error(send, 400, problem, "BadRequestError")
            receive, send = self._replay(body, receive), self._backpressure_to_429(send)
            if doc is None or not self._timed:
                return await self.app(scope, receive, send)
            return await TimedRequest(self.settings, send, streaming=doc.get("stream") is True).run(
                self.app, scope, receive)
        finally:
            self.ongoing -= 1

    async def _bounded_get(self, scope, receive, send):
        cap = self.settings.max_ongoing_gets
        if cap is not None and self.ongoing_gets >= cap:
            return await send_error(
                send, 429, f"Server overloaded: {self.ongoing_gets} GETs in flight (limit {cap}); retry later",
                "RateLimitError", [self._retry_header])
        self.ongoing_gets += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.ongoing_gets -= 1

    def _parse(self, path: str, body: bytes, ctype: str) -> tuple[Optional[dict], Optional[str]]:
        """(a generation request's JSON body or None, a problem worth a 400 or
        None). Bodies that are not JSON are left to the handlers' own 400."""
        if ctype not in ("", "application/json") and not ctype.endswith("+json"):
            return None, None  # a form (transcriptions)
        too_deep = f"JSON nested deeper than {self.settings.max_json_depth} levels"
        try:
            doc = json.loads(body)
        except RecursionError:  # deeper than the parser survives
            return None, too_deep
        except ValueError:
            return None, None
        if nested_deeper(doc, self.settings.max_json_depth):
            return None, too_deep
        return (doc if path in GENERATION_PATHS and isinstance(doc, dict) else None), None

    def _check_work(self, path: str, doc: Optional[dict]) -> Optional[str]:
        """The engine work one generation request asks for: sequences, tokens."""
        if doc is None:
            return None
        count = sequences(path, doc)
        if count > self.settings.max_n:
            return f"n x prompts must be at most {self.settings.max_n}, got {count}"
        cap = self.settings.max_request_tokens
        per_sequence = as_count(doc.get("max_completion_tokens") if path == "/v1/chat/completions"
                                and doc.get("max_completion_tokens") is not None else doc.get("max_tokens"))
        if cap is not None and per_sequence is not None and count * per_sequence > cap:
            return (f"sequences x max_tokens must be at most {cap} tokens, got {count} x {per_sequence} = "
                    f"{count * per_sequence}")
        return None

    def _check_options(self, doc: Optional[dict]) -> Optional[str]:
        """TokenFlow's own body fields that nothing downstream validates."""
        if doc is None:
            return None
        for key in (CONTINUATION_KEY, REBALANCE_KEY):
            if not isinstance(opt := doc.get(key, True), bool):
                return f"{key} must be true or false, got {json.dumps(opt)}"
        if (pin := doc.get(PIN_KEY)) is not None:
            if not self.settings.engine_pinning:
                return f"{PIN_KEY} is not allowed here (the app's admission.engine_pinning is off)"
            if not isinstance(pin, str) or not 0 < len(pin) <= 200:
                return f"{PIN_KEY} must be an engine id (a string), got {json.dumps(pin)[:80]}"
        return None

    @staticmethod
    async def _read_body(receive, limit: int) -> Optional[bytes]:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    def _replay(body: bytes, receive):
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: disconnect notifications
        return replay

    def _backpressure_to_429(self, send):
        """Serve's BackPressureError (engine max_queued_requests) arrives as a
        503 JSON error; hold a 503's start until its body shows whether it is
        that, then send 429 + Retry-After instead."""
        held = None

        async def wrapped(message):
            nonlocal held
            if message["type"] == "http.response.start" and message.get("status") == 503:
                held = message
                return
            if held is not None and message["type"] == "http.response.body":
                start, held = held, None
                body = message.get("body", b"")
                if b"backpressure" in body.lower() and not message.get("more_body", False):
                    return await send_error(
                        send, 429, "Server overloaded: engine queues are full; retry later",
                        "RateLimitError", [self._retry_header])
                await send(start)
            await send(message)
        return wrapped


class TimedRequest:
    """One generation request under the time limits and keepalives of
    AdmissionSettings. The app runs in the caller's task; a watchdog task
    wakes only when something falls due (a keepalive, a limit), so a busy
    stream costs it a wake-up per keepalive_s, not per chunk. On a limit
    the app's task is cancelled (the ingress then cancels its engine call:
    Serve does not carry a cancel from inside a replica on; the engine
    request is aborted), and the client gets 504, or, once an SSE stream has
    begun, an error event and [DONE]."""

    def __init__(self, settings: AdmissionSettings, send, streaming: bool):
        self.s = settings
        self._send = send
        self.streaming = streaming
        self._lock = asyncio.Lock()  # the app's sends and the watchdog's never interleave
        self.started = self.sse = self.sent_data = self.done = False
        self.last_send = self.t0 = asyncio.get_running_loop().time()
        self.fired: Optional[str] = None  # which limit ended the request

    async def send(self, message) -> None:
        async with self._lock:
            if self.done:
                return  # ended by a limit: the app's late sends go nowhere
            if message["type"] == "http.response.start":
                self.started = True
                self.sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in message.get("headers") or ())
            elif message["type"] == "http.response.body":
                self.sent_data = self.sent_data or bool(message.get("body"))
                self.done = not message.get("more_body", False)
            self.last_send = asyncio.get_running_loop().time()
            await self._send(message)

    def _next_due(self) -> tuple[float, Optional[str]]:
        """(when, what): the next limit or keepalive to look at."""
        due = [(float("inf"), None)]
        if self.s.request_timeout_s is not None:
            due.append((self.t0 + self.s.request_timeout_s, "request"))
        if self.streaming and not self.sent_data and self.s.first_token_timeout_s is not None:
            due.append((self.t0 + self.s.first_token_timeout_s, "first token"))
        if self.sse and self.s.keepalive_s is not None:
            due.append((self.last_send + self.s.keepalive_s, "keepalive"))
        elif self.s.keepalive_s is not None and not self.started:
            due.append((asyncio.get_running_loop().time() + self.s.keepalive_s, "check"))  # look again later
        return min(due, key=lambda d: d[0])

    async def _watch(self, task: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        while not self.done:
            when, what = self._next_due()
            if what is None:
                return
            await asyncio.sleep(max(0.0, when - loop.time()))
            when, what = self._next_due()  # again: a token or a send may have come meanwhile
            if self.done or what is None or loop.time() < when - 1e-3:
                continue
            if what in ("request", "first token"):
                self.fired = what
                task.cancel()
                return
            if what == "keepalive" and loop.time() - self.last_send >= self.s.keepalive_s:
                await self.send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})

    async def run(self, app, scope, receive) -> None:
        task = asyncio.current_task()
        watchdog = asyncio.get_running_loop().create_task(self._watch(task))
        try:
            await app(scope, receive, self.send)
        except asyncio.CancelledError:
            if self.fired is None:
                raise  # not ours: the client went away, or the server stops
            task.uncancel()
        finally:
            watchdog.cancel()
        if self.fired is not None:
            await self._end()  # also when the app took the cancel and returned

    async def _end(self) -> None:
        limit = (self.s.first_token_timeout_s if self.fired == "first token" else self.s.request_timeout_s)
        message = f"No token within {limit:g} s" if self.fired == "first token" else \
            f"The request took longer than {limit:g} s"
        message += "; the request was cancelled"
        async with self._lock:
            if self.done:
                return
            self.done = True
            if not self.started:
                await send_error(self._send, 504, message, "TimeoutError")
            elif self.sse:  # the event a lost engine's stream ends with, then [DONE]
                event = lost_event(message, "TimeoutError", 504)
                await self._send({"type": "http.response.body", "body": f"{event}data: [DONE]\n\n".encode()})
            else:
                await self._send({"type": "http.response.body", "body": b""})


def install(app, admission: Optional[dict] = None) -> None:
    """Add the guard to a FastAPI/Starlette app as its outermost middleware.
    Keys are read later, in the process that serves the app."""
    AdmissionSettings.from_dict(admission)  # fail at build time on a bad block
    app.add_middleware(TokenFlowGuard, admission=dict(admission or {}))
