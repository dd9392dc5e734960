"""Request routing: the Serve router that picks an engine by buffer slack, and
the ingress routes that show what it sees.

Configured on the engine deployment as
`request_router_config.request_router_class` (deployments/app.py does it when
`router.enabled`), so it runs inside every handle that calls the engines,
i.e. in each ingress replica.

Per request it only ranks a local table (actors/ranking.py): a background
task long-polls the app's router actor for every engine's state (answered
on each push), and sends made by this router count as load until
an engine's push reflects them. With no fresh state for any candidate (at
start, or when the actor is unreachable) it falls back to Serve's default,
power of two choices.

Serve pickles the router class by value, so module-level state here would not be
shared with the ingress's HTTP handlers: shared things live in actors/.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import List, Optional

from fastapi.responses import JSONResponse
from ray import serve
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from actors import kv_pool, ranking
from deployments import failover
from actors import router as router_actor
from tokenflow.metrics import RouterMetrics

logger = logging.getLogger("ray.serve")


class TokenFlowRequestRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._tf_settings = ranking.RouterSettings.from_dict(kwargs)
        self._tf_table = ranking.RoutingTable(self._tf_settings)
        self._tf_refresher: Optional[asyncio.Task] = None
        key = f"{self._deployment_id.app_name}/{self._deployment_id.name}#{id(self):x}"
        router_actor.LOCAL_ROUTERS[key] = self._tf_table
        # Exported through Ray's metrics agent (ray_tokenflow_router_*; tokenflow/metrics.py).
        self._tf_metrics = RouterMetrics(self._deployment_id.app_name, self._deployment_id.name)
        try:  # Serve builds routers on their event loop: start reading states now
            self._tf_refresher = asyncio.get_running_loop().create_task(self._refresh())
        except RuntimeError:
            pass  # no loop here: choose_replicas starts it

    def _table(self) -> ranking.RoutingTable:
        if not hasattr(self, "_tf_table"):
            self.initialize_state()
        # Started lazily: the router is built outside its event loop.
        if self._tf_refresher is None or self._tf_refresher.done():
            self._tf_refresher = asyncio.get_running_loop().create_task(self._refresh())
        return self._tf_table

    async def _refresh(self) -> None:
        # Long poll: the actor answers as soon as any engine pushes, so a
        # state is as old as its transit, not a polling period. The interval
        # only bounds how often this loop asks (and paces retries).
        handle, failures, seen = None, 0, -1
        interval = self._tf_settings.refresh_interval_s
        while True:
            started = time.monotonic()
            try:
                if handle is None:
                    handle = await asyncio.to_thread(router_actor.get_router, self.app_name)
                    seen = -1
                poll = handle.wait_snapshot.remote(seen, 1.0)
                seen, snap = await asyncio.wait_for(poll, timeout=10.0)
                self._tf_table.update(snap)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep routing (by fallback) whatever happens here
                handle, failures = None, failures + 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning(f"TokenFlow router: reading engine states failed ({failures}x): {e!r}")
                await asyncio.sleep(1.0)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def choose_replicas(self, candidate_replicas, pending_request=None) -> List[List]:
        start = time.perf_counter()
        table = self._table()
        order = None
        # LoRA requests keep Serve's multiplex-aware choice.
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            order = table.rank(by_id)
        if order is None:
            ranks = await super().choose_replicas(candidate_replicas, pending_request)
            self._tf_record(table, start, None)
            return ranks
        # One rank per engine, best first: Serve tries the next one only if
        # the previous one refuses (its queue is full).
        self._tf_record(table, start, order[0])
        # Serve picks among a rank by queue length, from its cache or else by
        # probing the replica with a 0.1-1 s deadline. Busy replicas miss it
        # (on 2 busy cores requests sat in the router for seconds, retrying),
        # so give Serve the counts the engines' states already hold.
        cache = self.replica_queue_len_cache
        for e in order:
            cache.update(by_id[e].replica_id, table.queue_len(e))
        return [[by_id[e]] for e in order]

    def _tf_record(self, table: ranking.RoutingTable, start: float, chosen: Optional[str]) -> None:
        seconds = time.perf_counter() - start
        table.record(seconds, chosen)
        self._tf_metrics.on_decision(seconds, chosen, table.age(chosen) if chosen is not None else None)

    def on_replica_actor_died(self, replica_id) -> None:
        # Serve saw it die on a request: stop ranking it before its state ages out.
        super().on_replica_actor_died(replica_id)
        table = getattr(self, "_tf_table", None)
        if table is not None:
            table.drop(replica_id.unique_id)

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        table = getattr(self, "_tf_table", None)
        if table is not None:
            table.on_sent(replica_id.unique_id)


# --- The ingress: OpenAI API plus what the routing sees ----------------------

# Routes added to ray.serve.llm's OpenAI endpoints (method name -> route).
TOKENFLOW_ENDPOINTS = {
    **DEFAULT_ENDPOINTS,
    "health": lambda app: app.get("/health"),
    "tokenflow_engines": lambda app: app.get("/v1/tokenflow/engines"),
}


class TokenFlowIngress(OpenAiIngress):
    """ray.serve.llm's OpenAI ingress plus GET /health and GET /v1/tokenflow/engines."""

    def __init__(self, llm_deployments, model_cards, *, tokenflow_router: Optional[dict] = None,
                 max_resends: int = 2, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._tf_settings = ranking.RouterSettings.from_dict(tokenflow_router)
        self._tf_max_resends = max_resends
        self._tf_lost = dict.fromkeys(failover.OUTCOMES, 0)
        self._tf_actor = None
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

    async def _get_response(self, *, body, call_method: str, raw_request=None):
        # A replica that dies under a request: re-send it if no token went
        # out yet, else end the stream with an error event (failover.py).
        def open_stream():
            return super(TokenFlowIngress, self)._get_response(
                body=body, call_method=call_method, raw_request=raw_request)

        async for item in failover.resend_until_first_token(open_stream, self._tf_max_resends, self._tf_on_lost):
            yield item

    def _tf_on_lost(self, outcome: str) -> None:
        self._tf_lost[outcome] += 1

    async def health(self):
        # The ingress answers; engine liveness is Serve's health checks' job.
        return {"status": "ok"}

    async def tokenflow_engines(self):
        """Every engine's pushed state as the router actor holds it (age,
        freshness, slack), and the view of each request router in this
        ingress process (pending sends, routing latency, state age)."""
        app = serve.get_replica_context().app_name
        try:
            if self._tf_actor is None:
                self._tf_actor = await asyncio.to_thread(router_actor.get_router, app)
            snap = await asyncio.wait_for(self._tf_actor.snapshot.remote(), timeout=5)
        except Exception as e:
            self._tf_actor = None
            return JSONResponse({"error": f"router actor unreachable: {e!r}"}, status_code=503)
        table = ranking.RoutingTable(self._tf_settings)
        table.update(snap)
        try:
            pools = await kv_pool.pool_stats()
        except Exception as e:
            pools = {"error": repr(e)}
        return {"app": app, "router_actor": router_actor.router_name(app),
                "settings": self._tf_settings.to_dict(),
                "engines": table.view()["engines"],
                "routers": {k: t.view() for k, t in list(router_actor.LOCAL_ROUTERS.items())},
                "replicas_lost": dict(self._tf_lost),
                "kv_pools": pools}
