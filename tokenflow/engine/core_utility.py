"""The EngineCore utility through which an engine replica reads TokenFlow's
scheduler state: `await engine_client.engine_core.call_utility_async(
"tokenflow_state")`. vLLM looks utility methods up by name on EngineCore,
so this module adds one; tokenflow/engine/scheduler.py imports it, which puts it
in every EngineCore process that loads the scheduler.

The answer is a plain dict (vLLM's msgpack channel carries it);
`SchedulerState.from_wire` rebuilds it on the replica. {} under any other
scheduler.
"""

from __future__ import annotations

from vllm.v1.engine.core import EngineCore

from tokenflow.core.sched_state import UTILITY


def _tokenflow_state(engine_core) -> dict:
    state = getattr(engine_core.scheduler, "scheduler_state", None)
    return state().to_wire() if state is not None else {}


setattr(EngineCore, UTILITY, _tokenflow_state)
