"""The global router actor: one per Serve app, holding every engine's state.

Engines push their state here every push interval (fire-and-forget); each
ingress's request router reads a snapshot every refresh interval and ranks
locally (actors/ranking.py), so no request ever waits on this actor.

The actor is detached and named after the app, so the first engine or
ingress that asks creates it (get_if_exists) and every other one finds it.
`serve.shutdown()` does not remove it: `kill_app_actors()` does (a cluster
that `serve run` started goes away with it anyway).
"""

from __future__ import annotations

import time

import ray

NAMESPACE = "tokenflow"

# Request routers living in this process, by deployment, so the ingress's
# /v1/tokenflow/engines can show exactly what its router sees. Serve pickles
# the router class by value, so the registry must live in a module it
# imports by name (this one), not in deployments/router.py.
LOCAL_ROUTERS: dict = {}


def router_name(app_name: str) -> str:
    return f"tokenflow-router:{app_name or 'default'}"


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor:
    def __init__(self, forget_after_s: float = 60.0):
        self._forget_after_s = forget_after_s
        self._states: dict[str, dict] = {}
        self._received: dict[str, float] = {}  # this actor's monotonic clock
        self.pushes = 0

    def push(self, state: dict) -> None:
        eid = state["engine_id"]
        self._states[eid] = state
        self._received[eid] = time.monotonic()
        self.pushes += 1

    def forget(self, engine_id: str) -> None:
        self._states.pop(engine_id, None)
        self._received.pop(engine_id, None)

    def snapshot(self) -> dict[str, tuple[dict, float]]:
        """engine_id -> (state, seconds since it arrived). Ages, not timestamps,
        so readers on other hosts need no synchronised clocks."""
        now = time.monotonic()
        for eid in [e for e, t in self._received.items() if now - t > self._forget_after_s]:
            self.forget(eid)  # a replica that is gone for good
        return {eid: (st, now - self._received[eid]) for eid, st in self._states.items()}

    def stats(self) -> dict:
        return {"engines": len(self._states), "pushes": self.pushes}


def get_router(app_name: str):
    """Handle to the app's router actor, created on first use."""
    return RouterActor.options(name=router_name(app_name), namespace=NAMESPACE,
                               get_if_exists=True, lifetime="detached").remote()


def kill_app_actors(app_name: str) -> bool:
    try:
        ray.kill(ray.get_actor(router_name(app_name), namespace=NAMESPACE), no_restart=True)
        return True
    except ValueError:
        return False
