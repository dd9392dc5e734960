"""The OpenAI ingress: ray.serve.llm's OpenAI API, re-sends of requests
whose engine died before their first token (failover.py), continuation of
streams whose engine died after it (continuation.py), GET /health, and
GET /v1/tokenflow/engines (what the slack routing sees).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Optional

from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.llm.ingress import OpenAiIngress

from tokenflow.serve import continuation, failover, guard, kv_pool
from tokenflow.serve.ray_private import DEFAULT_ENDPOINTS
from tokenflow.serve.routing import board, ranking

logger = logging.getLogger("ray.serve")


# Routes added to ray.serve.llm's OpenAI endpoints (method name -> route).
TOKENFLOW_ENDPOINTS = {
    **DEFAULT_ENDPOINTS,
    "health": lambda app: app.get("/health"),
    "tokenflow_engines": lambda app: app.get("/v1/tokenflow/engines"),
}


# A pushed state older than this does not count as an engine able to serve
# (/health): far above the push interval, so that a busy moment of the host
# does not flap the health check.
HEALTH_STATE_AGE_S = 5.0


# The engine calls of the current request's attempt (failover.py): a
# context variable, since Serve LLM's ingress makes the call inside its own
# _get_response and keeps the response object to itself.
ATTEMPT: contextvars.ContextVar[list | None] = contextvars.ContextVar("tokenflow_attempt", default=None)


class RecordingHandle:
    """A Serve handle that also records each call it makes in ATTEMPT, so
    that a re-send can cancel the attempt it abandons. Everything else goes
    to the wrapped handle (`.options(...)`, `.chat`, ... return wrappers too)."""

    def __init__(self, handle):
        self._handle = handle

    def options(self, **kwargs) -> "RecordingHandle":
        return RecordingHandle(self._handle.options(**kwargs))

    def __getattr__(self, name: str):
        attr = getattr(self._handle, name)  # `.chat` etc. are handles for that method
        return RecordingHandle(attr) if hasattr(attr, "remote") and hasattr(attr, "options") else attr

    def remote(self, *args, **kwargs):
        response = self._handle.remote(*args, **kwargs)
        attempt = ATTEMPT.get()
        if attempt is not None:
            attempt.append(response)
        return response


# Cancellations in flight (abandon_soon): a task nobody holds may be collected.
_ABANDONING: set = set()


class Attempts:
    """One request's attempts (failover.py): open() starts one, recording
    its engine calls; abandon() cancels them before a re-send."""

    def __init__(self):
        self.calls: list = []

    def open(self, start):
        self.calls = []
        ATTEMPT.set(self.calls)  # RecordingHandle adds this attempt's engine call
        return start()

    async def abandon(self) -> None:
        # Best effort, and off the event loop: Serve's cancel may wait for
        # the router's loop to hand over the replica's result.
        for response in self.calls:
            try:
                await asyncio.to_thread(response.cancel)
            except Exception as e:
                logger.info(f"TokenFlow ingress: cancelling an abandoned attempt failed: {e!r}")

    def abandon_soon(self) -> None:
        """abandon() in a task of its own, for a request that is being
        cancelled and cannot wait for it."""
        task = asyncio.get_running_loop().create_task(self.abandon())
        _ABANDONING.add(task)
        task.add_done_callback(_ABANDONING.discard)


def _ingress_metrics():
    """The failover's metrics, labelled with this replica's app and
    deployment; None outside a Serve replica."""
    from tokenflow.serve.metrics import IngressMetrics

    try:
        ctx = serve.get_replica_context()
    except Exception:
        return None
    return IngressMetrics(ctx.app_name, ctx.deployment, failover.OUTCOMES, failover.CAUSES)


class TokenFlowIngress(OpenAiIngress):
    """ray.serve.llm's OpenAI ingress plus GET /health and GET /v1/tokenflow/engines."""

    def __init__(self, llm_deployments, model_cards, *, tokenflow_router: Optional[dict] = None,
                 max_resends: int = 2, max_continuations: int = 2, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._tf_settings = ranking.RoutingSettings.from_dict(tokenflow_router)
        self._tf_max_resends = max_resends
        self._tf_max_continuations = max_continuations
        self._tf_lost = dict.fromkeys(failover.OUTCOMES, 0)
        self._tf_lost_by_cause = dict.fromkeys(failover.CAUSES, 0)
        self._tf_metrics = _ingress_metrics()
        self._tf_boards = None  # handles to the app's state boards
        # Serve creates a handle's request router on its first call. Make one
        # call now, so the router has read the engines' states before the
        # first user request instead of routing it blind.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for handle in self._default_serve_handles.values():
            loop.create_task(self._warm_up(handle))

    @staticmethod
    async def _warm_up(handle) -> None:
        try:
            await handle.llm_config.remote()
        except Exception as e:  # only a head start; requests work without it
            logger.info(f"TokenFlow ingress: router warm-up call failed: {e!r}")

    def _get_configured_serve_handle(self, model_id: str):
        return RecordingHandle(super()._get_configured_serve_handle(model_id))

    async def _get_response(self, *, body, call_method: str, raw_request=None):
        # A replica that dies under a request: re-send it if no token went
        # out yet, else continue the stream on another engine or end it with
        # an error event (failover.py, continuation.py).
        attempts = Attempts()
        ledger = None
        if self._tf_max_continuations and continuation.continuable(body, call_method):
            ledger = continuation.Ledger(body, call_method, self._tf_settings.reader_rate,
                                         self._tf_max_continuations, on_splice=self._tf_on_splice)

        def call(request, method):
            return attempts.open(lambda: super(TokenFlowIngress, self)._get_response(
                body=request, call_method=method, raw_request=raw_request))

        sends = 0

        def open_stream():
            nonlocal sends
            sends += 1
            gen = call(body if sends == 1 else failover.unpinned(body), call_method)
            return ledger.watch(gen) if ledger is not None else gen

        def continue_after(to: str | None):
            request = ledger.continuation(to) if ledger is not None else None
            return None if request is None else lambda: ledger.splice(call(request, "completions"))

        # A lost engine leaves the slack routing within a push and a long
        # poll; a re-send waits that long so it goes elsewhere.
        settle = (self._tf_settings.push_interval_s + self._tf_settings.refresh_interval_s
                  if self._tf_settings.enabled else 0.0)
        whole = False  # a whole answer (or an error) came back: the engine call is over
        try:
            async for item in failover.relay(open_stream, self._tf_max_resends, self._tf_on_lost, settle,
                                             attempts.abandon, continue_after,
                                             ledger.closing if ledger is not None else None):
                whole = not isinstance(item, (str, list))  # stream chunks are SSE text, or lists of it
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled or dropped inside this replica (the guard's time
            # limits): Serve carries only its own cancellations on to the
            # engine replica, so the engine call is cancelled here. Not after
            # a whole answer: Serve LLM's ingress reads just that one item
            # and drops the generator, with nothing left to cancel.
            if not whole:
                attempts.abandon_soon()
            raise

    def _tf_on_lost(self, outcome: str, cause: str) -> None:
        self._tf_lost[outcome] += 1
        self._tf_lost_by_cause[cause] += 1
        if self._tf_metrics is not None:
            self._tf_metrics.on_lost(outcome, cause)

    def _tf_on_splice(self, gap_s: float, stall_s: float) -> None:
        if self._tf_metrics is not None:
            self._tf_metrics.on_splice(gap_s, stall_s)

    async def health(self):
        """200 while some engine can serve: one whose state reached this
        ingress's slack router lately (an engine whose EngineCore died
        leaves at once, a dead replica within seconds); else 503, so that a
        load balancer sends elsewhere. Without the slack routing, or before
        its first read of the states, it answers for the ingress alone."""
        tables = list(board.LOCAL_ROUTERS.values())
        if not self._tf_settings.enabled or not any(t.has_read for t in tables):
            return {"status": "ok"}
        max_age = max(HEALTH_STATE_AGE_S, 10 * self._tf_settings.stale_after_s)
        serving = max(t.serving_engines(max_age) for t in tables)
        if serving:
            return {"status": "ok", "engines": serving}
        return JSONResponse({"status": "unavailable", "engines": 0}, status_code=503)

    async def tokenflow_engines(self):
        """Every engine's pushed state as the state board holds it (age,
        freshness, slack), and the view of each request router in this
        ingress process (pending sends, routing latency, state age), and
        its admission slots in use."""
        app = serve.get_replica_context().app_name
        try:
            s = self._tf_settings
            if self._tf_boards is None:
                self._tf_boards = [await asyncio.to_thread(board.get_board, app, shard, s)
                                   for shard in range(s.board_shards)]
            snap = {}
            for part in await asyncio.wait_for(asyncio.gather(*(b.snapshot.remote() for b in self._tf_boards)), 5):
                snap.update(part)
        except Exception as e:
            self._tf_boards = None
            return JSONResponse({"error": f"state board unreachable: {e!r}"}, status_code=503)
        table = ranking.RoutingTable(self._tf_settings)
        table.update(snap)
        try:
            pools = await kv_pool.pool_stats()
        except Exception as e:
            pools = {"error": repr(e)}
        s = self._tf_settings
        return {"app": app, "state_board": board.board_name(app, 0, s),
                "state_boards": [board.board_name(app, i, s) for i in range(s.board_shards)],
                "settings": self._tf_settings.to_dict(),
                "engines": table.view()["engines"],
                "routers": {k: t.view() for k, t in list(board.LOCAL_ROUTERS.items())},
                "replicas_lost": dict(self._tf_lost),
                "replicas_lost_by_cause": dict(self._tf_lost_by_cause),
                "admission": guard.admission_view(),
                "kv_pools": pools}
