"""TokenFlowLLMServer: Ray Serve LLM's LLMServer plus a per-request reading rate.

Clients state how fast they read a stream as `consumption_rate` (tokens/s),
either as a top-level body field or as `vllm_xargs.consumption_rate`. vLLM
only forwards `vllm_xargs` to the engine (as `SamplingParams.extra_args`, which
the TokenFlow scheduler reads), and a top-level unknown field survives the
OpenAI ingress only as the pydantic request's `model_extra`. So this class
validates the rate and writes it into `vllm_xargs` before the engine sees it.

It also keeps the replica's own view of its streams (one ReaderBuffer per
streaming request, fed from the chunks it sends) and, under Serve, starts an
EngineAgent that pushes that state to the app's state board and registers
with the node's KV pool actor (tokenflow/serve/), and exports the replica's
Prometheus metrics (tokenflow/serve/metrics.py: per request from the tracker,
sampled by the agent).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, AsyncGenerator, Optional

from ray import serve
from ray.serve.llm import LLMServer
from ray.serve.llm.openai_api_models import ErrorResponse

from tokenflow.core.config import MOVABLE_KEY, RATE_KEY, TokenFlowConfig, parse_carried, parse_rate
from tokenflow.core.sched_state import UTILITY, SchedulerState
from tokenflow.serve.continuation import end_on_whole_character
from tokenflow.serve.failover import CORE_DIED, STOPPING, EngineLost, bounce_if_engine_dead
from tokenflow.serve.kv_pool import KVPoolSettings
from tokenflow.serve.ray_private import ErrorInfo, replica_stopping
from tokenflow.serve.routing.ranking import RoutingSettings
from tokenflow.serve.streams import EngineTracker, tracked

logger = logging.getLogger("ray.serve")


def tokenflow_config_of(llm_config) -> TokenFlowConfig:
    """The TokenFlow knobs live in engine_kwargs.additional_config.tokenflow,
    the same dict the scheduler reads inside the EngineCore process, so the
    replica and the scheduler can never disagree (e.g. on default_rate)."""
    additional = llm_config.engine_kwargs.get("additional_config") or {}
    return TokenFlowConfig.from_dict(additional.get("tokenflow"))


def bad_request(message: str, param: Optional[str] = RATE_KEY) -> ErrorResponse:
    # The OpenAI ingress turns an ErrorResponse that is the *first* item a
    # replica yields into an HTTP error whose status is `error.code`; raising
    # an exception here instead would surface as a 500.
    return ErrorResponse(
        error=ErrorInfo(message=message, type="BadRequestError", param=param, code=400)
    )


def apply_consumption_rate(request: Any, cfg: TokenFlowConfig) -> Optional[ErrorResponse]:
    """Validate the stated rate and store it in request.vllm_xargs.

    Returns an ErrorResponse for an invalid rate, None on success."""
    top = (request.model_extra or {}).get(RATE_KEY)
    xargs = dict(request.vllm_xargs or {})
    nested = xargs.get(RATE_KEY)
    if top is not None and nested is not None and top != nested:
        return bad_request(
            f"{RATE_KEY} given twice with different values ({top!r} and vllm_xargs {nested!r})"
        )
    try:
        rate = parse_rate(top if top is not None else nested, cfg)
    except ValueError as e:
        return bad_request(str(e))
    # Always set it (the default too) so the scheduler sees one explicit value.
    xargs[RATE_KEY] = rate
    request.vllm_xargs = xargs
    return None


async def _yield_once(item: Any) -> AsyncGenerator[Any, None]:
    yield item


class TokenFlowLLMServer(LLMServer):
    """LLMServer that maps `consumption_rate` into `vllm_xargs` and tracks its
    streams for the router. Only chat and completions generate tokens.

    `tokenflow_cluster` ({"router": {...}, "kv_pool": {...}}, the app args'
    blocks) is bound by tokenflow/serve/app.py; absent, the defaults apply."""

    async def __init__(self, llm_config, *, tokenflow_cluster: Optional[dict] = None, **kwargs):
        # Parse before the (slow) engine start so a bad config fails fast.
        self._tokenflow_cfg = tokenflow_config_of(llm_config)
        cluster = tokenflow_cluster or {}
        self._router_settings = RoutingSettings.from_dict(cluster.get("router"))
        self._kv_settings = KVPoolSettings.from_dict(cluster.get("kv_pool"))
        self._metrics = _engine_metrics(llm_config)
        self._tracker = EngineTracker(horizon_s=self._router_settings.horizon_s, sink=self._metrics)
        self._agent = None
        if _offload_wanted(llm_config, self._kv_settings):
            try:
                _enable_offload(llm_config, self._kv_settings, await _host_pool_slot(self._kv_settings))
            except NoHostSlot as e:
                # E.g. a /dev/shm too small for the pool, or every slot held
                # by a live engine: serve, without a host tier (pauses then
                # recompute), rather than fail to start or exceed the pool.
                logger.warning("TokenFlow: %s; this engine runs without a host KV tier "
                               "(kv_pool.shared_memory: false gives each engine its own share)", e)
        self._stopping = _stopping_flag()
        await super().__init__(llm_config, **kwargs)
        self._tracker.slots = self._max_num_seqs()
        # Only now: the router must never see an engine that cannot serve yet.
        self._agent = _start_agent(self._tracker, self._router_settings, self._kv_settings,
                                   self._scheduler_state, self._metrics, self._engine_dead, self._stopping)

    async def _scheduler_state(self) -> SchedulerState | None:
        """The TokenFlow scheduler's state, via its EngineCore utility
        (tokenflow/engine/core_utility.py); None under another scheduler."""
        core = getattr(getattr(self.engine, "_engine_client", None), "engine_core", None)
        if core is None:
            return None
        return SchedulerState.from_wire(await core.call_utility_async(UTILITY))

    def _max_num_seqs(self) -> int | None:
        """Requests the engine runs at once, as vLLM resolved it (the
        engine's default where the config does not say); None if unknown."""
        client = getattr(self.engine, "_engine_client", None)
        sched = getattr(getattr(client, "vllm_config", None), "scheduler_config", None)
        n = getattr(sched, "max_num_seqs", None)
        return n if isinstance(n, int) and n > 0 else None

    def _tokenizer(self):
        """The engine's own tokenizer (the one its detokenizer uses); None
        when the engine runs without one."""
        return getattr(getattr(self.engine, "_engine_client", None), "tokenizer", None)

    def _engine_dead(self) -> bool:
        """Whether this replica's vLLM EngineCore has died (AsyncLLM.errored):
        the replica lives on until Serve's health check replaces it, but
        cannot serve."""
        client = getattr(self.engine, "_engine_client", None)
        return bool(getattr(client, "errored", False))

    def _refuse_if_engine_dead(self) -> None:
        """A request that reaches a replica whose engine is dead, or which
        Serve is stopping, goes back to the ingress to be sent elsewhere."""
        if self._engine_dead():
            raise EngineLost(CORE_DIED)
        if self._stopping():
            raise EngineLost(STOPPING)

    def _track(self, request, gen, arrival: float):
        if not hasattr(gen, "__aiter__"):
            return gen
        gen = bounce_if_engine_dead(gen, self._engine_dead, self._stopping)
        xargs = request.vllm_xargs
        return tracked(gen, self._tracker, rate=float(xargs[RATE_KEY]),
                       stream=bool(getattr(request, "stream", False)), arrival=arrival,
                       # usage counts every choice; the deltas only choice 0
                       use_usage=(getattr(request, "n", 1) or 1) == 1, carried=parse_carried(xargs),
                       movable=xargs.get(MOVABLE_KEY) == 1)

    async def chat(self, request, raw_request_info=None):
        arrival = time.monotonic()
        self._refuse_if_engine_dead()
        if (error := apply_consumption_rate(request, self._tokenflow_cfg)) is not None:
            return _yield_once(error)
        return self._track(request, await super().chat(request, raw_request_info), arrival)

    async def completions(self, request, raw_request_info=None):
        arrival = time.monotonic()
        self._refuse_if_engine_dead()
        if (error := apply_consumption_rate(request, self._tokenflow_cfg)) is not None:
            return _yield_once(error)
        if (tokenizer := self._tokenizer()) is not None:  # a continued stream: whole characters
            end_on_whole_character(request, tokenizer.decode)
        return self._track(request, await super().completions(request, raw_request_info), arrival)

    async def __del__(self):
        if getattr(self, "_agent", None) is not None:
            self._agent.stop()
        await super().__del__()


def _stopping_flag():
    """Whether Serve has begun to stop this replica; never, outside Serve."""
    try:
        flag = replica_stopping()
    except Exception:  # a Ray without that private attribute: no handover
        logger.warning("TokenFlow: cannot see when Serve stops this replica; streams will not be handed over")
        flag = None
    return flag or (lambda: False)


def _offload_wanted(llm_config, kv: KVPoolSettings) -> bool:
    # Not when off, or when the user configured a connector of their own.
    return kv.enabled and kv.offload and "kv_transfer_config" not in llm_config.engine_kwargs


async def _host_pool_slot(kv: KVPoolSettings):
    """This replica's slot of its node's shared host KV pool (a
    tokenflow.kv_offload.host_shm.Region), from the node's pool actor; None when the
    pool is not shared memory or outside a Serve replica (a unit test)."""
    if not kv.shared_memory:
        return None
    try:
        ctx = serve.get_replica_context()
    except Exception:
        return None
    import ray

    from tokenflow.kv_offload.host_shm import Region
    from tokenflow.serve.kv_pool import get_node_pool

    node_id = ray.get_runtime_context().get_node_id()
    for attempt in range(3):
        try:
            pool = await asyncio.to_thread(get_node_pool, node_id, kv)
            ref = pool.acquire_slot.remote(ctx.replica_id.unique_id, os.getpid())
            return Region(**await asyncio.wait_for(ref, timeout=60))
        except ray.exceptions.RayActorError:
            # The pool was removing itself, unused (kv_pool.idle_exit_s): once
            # it is gone, the next look-up creates a new one.
            await asyncio.sleep(1.0 + attempt)
        except Exception as e:
            raise NoHostSlot(f"no slot of node {node_id}'s shared host KV pool: {e}") from e
    raise NoHostSlot(f"no slot of node {node_id}'s shared host KV pool: its actor kept exiting")


class NoHostSlot(RuntimeError):
    pass


def _enable_offload(llm_config, kv: KVPoolSettings, region=None) -> None:
    """Give the engine its host KV tier (when `_offload_wanted`): its slot of
    the node's shared pool, or (no region) its fixed share allocated by the
    engine itself."""
    from tokenflow.kv_offload import kv_transfer_config

    # update_engine_kwargs also reaches the engine config Ray may have built.
    llm_config.update_engine_kwargs(kv_transfer_config=kv_transfer_config(
        host_pool_bytes=None if region else kv.engine_bytes(), region=region, tokenflow_connector=True))


def _engine_metrics(llm_config):
    """This replica's Prometheus metrics, tagged with the model and the
    engine id the router uses; None outside a Serve replica."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # built outside a Serve replica (e.g. a unit test)
        return None
    from tokenflow.serve.metrics import EngineMetrics

    return EngineMetrics(model=llm_config.model_id, engine=ctx.replica_id.unique_id)


def _start_agent(tracker, router: RoutingSettings, kv: KVPoolSettings, scheduler_state=None, metrics=None,
                 engine_dead=None, stopping=None):
    if not (router.enabled or kv.enabled or metrics is not None):
        return None
    try:
        ctx = serve.get_replica_context()
    except Exception:  # built outside a Serve replica (e.g. a unit test)
        return None
    from tokenflow.serve.routing.agent import EngineAgent

    agent = EngineAgent(tracker, router, kv, app_name=ctx.app_name, engine_id=ctx.replica_id.unique_id,
                        replica=ctx.replica_id.to_full_id_str(), scheduler_state=scheduler_state,
                        metrics=metrics, engine_dead=engine_dead, stopping=stopping)
    agent.start()
    return agent
