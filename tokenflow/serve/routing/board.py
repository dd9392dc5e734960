"""The state board: one actor per Serve app, holding every engine's state.

Engines push their state here every push interval (fire-and-forget); each
ingress's request router long-polls for snapshots (`wait_snapshot` answers
as soon as a push newer than the caller's last one arrives) and ranks
locally (tokenflow/serve/routing/ranking.py), so no request ever waits on this actor and a
state reaches the routers within a transit time of its push, not a refresh
interval later.

The actor is detached and named after the app, so the first engine or
ingress that asks creates it (get_if_exists) and every other one finds it.
`serve.shutdown()` does not remove it: `kill_app_actors()` does (a cluster
that `serve run` started goes away with it anyway).
"""

from __future__ import annotations

import asyncio
import time

import ray

NAMESPACE = "tokenflow"

# Request routers living in this process, by deployment, so the ingress's
# /v1/tokenflow/engines can show exactly what its router sees. Serve pickles
# the router class by value, so the registry must live in a module it
# imports by name (this one), not in tokenflow/serve/ingress.py.
LOCAL_ROUTERS: dict = {}


def board_name(app_name: str) -> str:
    return f"tokenflow-board:{app_name or 'default'}"


class StateBoard:
    """The state board's body (plain class, so tests can drive it without Ray)."""

    def __init__(self, forget_after_s: float = 60.0):
        self._forget_after_s = forget_after_s
        self._states: dict[str, dict] = {}
        # When each state was fresh, on this actor's monotonic clock: its
        # arrival, less the transit since the engine sent it.
        self._received: dict[str, float] = {}
        self.pushes = 0
        self._changed = asyncio.Event()  # set on every push; long polls wait on it

    # Every method is async, so all run on the actor's one event loop (the
    # long poll's Event is not thread-safe). The frequent calls keep no task
    # events: at tens per second they grew the GCS by a third in a
    # 2,000-request soak (docs/RELIABILITY.md).
    @ray.method(enable_task_events=False)
    async def push(self, state: dict) -> None:
        eid = state["engine_id"]
        self._states[eid] = state
        # sent_at is the engine's wall clock: count transit too when the two
        # clocks plausibly agree (same host, or NTP), never more than 1 s.
        transit = min(max(time.time() - float(state.get("sent_at") or time.time()), 0.0), 1.0)
        self._received[eid] = time.monotonic() - transit
        self.pushes += 1
        self._changed.set()

    async def forget(self, engine_id: str) -> None:
        self._forget(engine_id)
        self.pushes += 1  # a change: the long polls answer now
        self._changed.set()

    def _forget(self, engine_id: str) -> None:
        self._states.pop(engine_id, None)
        self._received.pop(engine_id, None)

    async def snapshot(self) -> dict[str, tuple[dict, float]]:
        return self._snapshot()

    def _snapshot(self) -> dict[str, tuple[dict, float]]:
        """engine_id -> (state, seconds since it was sent). Ages, not timestamps,
        so readers on other hosts need no synchronised clocks."""
        now = time.monotonic()
        for eid in [e for e, t in self._received.items() if now - t > self._forget_after_s]:
            self._forget(eid)  # a replica that is gone for good
        return {eid: (st, now - self._received[eid]) for eid, st in self._states.items()}

    @ray.method(enable_task_events=False)
    async def wait_snapshot(self, after: int, timeout_s: float = 1.0) -> tuple[int, dict]:
        """(push count, snapshot) as soon as there has been a push past `after`,
        or after timeout_s (then possibly unchanged: ages still advance)."""
        if self.pushes <= after:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.pushes, self._snapshot()

    async def stats(self) -> dict:
        return {"engines": len(self._states), "pushes": self.pushes}


StateBoardActor = ray.remote(num_cpus=0, max_restarts=-1)(StateBoard)


def get_board(app_name: str):
    """Handle to the app's state board, created on first use."""
    return StateBoardActor.options(name=board_name(app_name), namespace=NAMESPACE,
                               get_if_exists=True, lifetime="detached").remote()


def kill_app_actors(app_name: str) -> bool:
    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace=NAMESPACE), no_restart=True)
        return True
    except ValueError:
        return False
