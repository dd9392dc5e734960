"""The state board: one actor per Serve app, holding every engine's state.

Engines push their state here (fire-and-forget) at a push interval's tick
when something a router acts on has changed, and at least every half
staleness bound (agent.py: EngineAgent._worth_pushing); each
ingress's request router long-polls for snapshots (`wait_snapshot` answers
as soon as a push newer than the caller's last one arrives) and ranks
locally (tokenflow/serve/routing/ranking.py), so no request ever waits on this actor and a
state reaches the routers within a transit time of its push, not a refresh
interval later.

The actor is detached and named after the app and a digest of its router
settings, so the first engine or ingress that asks creates it
(get_if_exists) and every other one of the same settings finds it.
`serve.shutdown()` does not remove it: it removes itself once no engine
has pushed to it and no ingress polled it for a minute, or
`kill_app_actors()` does (a cluster that
`serve run` started goes away with it anyway).

At scale (docs/SCALING.md) two things keep it bounded: an app may split
its engines among `board_shards` boards (by a hash of the engine's id, or
of its node's with node relays; each ingress follows all of them), so no
one actor takes every push; and a
long poll answers with the board's head, the engines with the most slack
(`head_size` over all boards; all of them when there are fewer), in routing
fields only, so what an ingress reads and ranks per request does not grow
with the cluster.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
import zlib

import ray

from tokenflow.serve.idle import exit_when_idle
from tokenflow.serve.routing.ranking import EngineState, RoutingSettings, slack

logger = logging.getLogger("ray.serve")

NAMESPACE = "tokenflow"

# Request routers living in this process, by deployment, so the ingress's
# /v1/tokenflow/engines can show exactly what its router sees. Serve pickles
# the router class by value, so the registry must live in a module it
# imports by name (this one), not in tokenflow/serve/ingress.py.
LOCAL_ROUTERS: dict = {}


# Fields a long poll leaves out of each engine's row: for people reading
# /v1/tokenflow/engines (which takes the full snapshot), not for ranking.
DISPLAY_ONLY = ("scheduler", "replica", "pid", "node_id")


def board_prefix(app_name: str) -> str:
    return f"tokenflow-board:{app_name or 'default'}@"


def board_name(app_name: str, shard: int = 0, settings: RoutingSettings | None = None) -> str:
    """Named by the app and a digest of its router settings: a redeploy that
    changes them gets boards of its own (the old ones remove themselves
    once their engines are gone)."""
    base = board_prefix(app_name) + (settings or RoutingSettings()).fingerprint()
    return base if shard == 0 else f"{base}#{shard}"


def shard_of(engine_id: str, shards: int) -> int:
    """The board an engine pushes to: stable across processes (not hash())."""
    return zlib.crc32(engine_id.encode()) % shards if shards > 1 else 0


class StateBoard:
    """The state board's body (plain class, so tests can drive it without Ray)."""

    def __init__(self, forget_after_s: float = 60.0, settings: dict | None = None):
        self._forget_after_s = forget_after_s
        self._settings = RoutingSettings.from_dict(settings)
        self._states: dict[str, dict] = {}
        # Each engine's slack as of its last push (the head's order), and the
        # best decode rate any engine has shown (slack's peer capacity).
        self._slack: dict[str, float] = {}
        self._best_tps = 0.0
        self._head: tuple[int, list[str]] | None = None  # (pushes, ids) of the last head computed
        # When each state was fresh, on this actor's monotonic clock: its
        # arrival, less the transit since the engine sent it.
        self._received: dict[str, float] = {}
        self.pushes = 0  # engine states taken (the long polls' version)
        self.messages = 0  # push and push_many calls
        self.used_at = time.monotonic()  # the last push, push_many or long poll (or the start)
        self._changed = asyncio.Event()  # set on every push; long polls wait on it

    # Every method is async, so all run on the actor's one event loop (the
    # long poll's Event is not thread-safe). The frequent calls keep no task
    # events: at tens per second they grew the GCS by a third in a
    # 2,000-request soak (docs/RELIABILITY.md).
    @ray.method(enable_task_events=False)
    async def push(self, state: dict) -> None:
        self._take(state)
        self.messages += 1
        self._changed.set()
        self.used_at = time.monotonic()

    @ray.method(enable_task_events=False)
    async def push_many(self, states: list[dict]) -> None:
        """Several engines' states in one message (a node's relay, relay.py)."""
        for state in states:
            self._take(state)
        self.messages += 1
        self._changed.set()
        self.used_at = time.monotonic()

    def _take(self, state: dict) -> None:
        eid = state["engine_id"]
        self._states[eid] = state
        st = EngineState.from_dict(state)
        self._best_tps = max(self._best_tps, st.peak_tps)
        self._slack[eid] = slack(st, self._settings, self._best_tps)
        # sent_at is the engine's wall clock: count transit too when the two
        # clocks plausibly agree (same host, or NTP), never more than 1 s.
        transit = min(max(time.time() - float(state.get("sent_at") or time.time()), 0.0), 1.0)
        self._received[eid] = time.monotonic() - transit
        self.pushes += 1

    async def forget(self, engine_id: str) -> None:
        self._forget(engine_id)
        self.pushes += 1  # a change: the long polls answer now
        self._changed.set()

    def _forget(self, engine_id: str) -> None:
        self._states.pop(engine_id, None)
        self._received.pop(engine_id, None)
        self._slack.pop(engine_id, None)

    async def snapshot(self) -> dict[str, tuple[dict, float]]:
        return self._snapshot()

    def _snapshot(self) -> dict[str, tuple[dict, float]]:
        """engine_id -> (state, seconds since it was sent). Ages, not timestamps,
        so readers on other hosts need no synchronised clocks."""
        now = time.monotonic()
        for eid in [e for e, t in self._received.items() if now - t > self._forget_after_s]:
            self._forget(eid)  # a replica that is gone for good
        return {eid: (st, now - self._received[eid]) for eid, st in self._states.items()}

    def _head_snapshot(self) -> dict[str, tuple[dict, float]]:
        """What a long poll answers: this board's share of the head (head_size
        over board_shards, rounded up: an ingress's table stays about
        head_size rows however many boards it follows), the engines with
        the most slack among those the ingresses would still rank (state at
        most twice stale_after_s old), or every engine when there are no more;
        routing fields only."""
        now = time.monotonic()
        s = self._settings
        size = -(-s.head_size // s.board_shards)  # this board's share of the head
        if len(self._states) <= size:
            ids = list(self._states)
        else:
            if self._head is None or self._head[0] != self.pushes:
                window = 2 * s.stale_after_s
                live = [e for e, t in self._received.items() if now - t <= window and e in self._slack]
                self._head = (self.pushes, heapq.nlargest(size, live, key=self._slack.__getitem__))
            ids = self._head[1]
        out = {}
        for eid in ids:
            st = self._states.get(eid)
            if st is not None:
                row = {k: v for k, v in st.items() if k not in DISPLAY_ONLY}
                out[eid] = (row, now - self._received[eid])
        return out

    @ray.method(enable_task_events=False)
    async def wait_snapshot(self, after: int, timeout_s: float = 1.0) -> tuple[int, dict]:
        """(push count, head) as soon as there has been a push past `after`,
        or after timeout_s (then possibly unchanged: ages still advance)."""
        self.used_at = time.monotonic()
        if self.pushes <= after:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self._snapshot()  # forgets engines gone for good
        return self.pushes, self._head_snapshot()

    async def stats(self) -> dict:
        # cpu_s: this actor process's CPU time (benches take differences).
        return {"engines": len(self._states), "pushes": self.pushes, "messages": self.messages,
                "cpu_s": time.process_time()}


class DetachedBoard(StateBoard):
    """The board as a detached actor. Once no engine has pushed to it and
    no ingress has polled it for `forget_after_s`, it removes itself. The
    engines of a live app push at least every stale_after_s / 2 and its
    ingresses poll every board of the app, one no engine pushes to
    included (board_shards above the engines' nodes), so only a board left
    behind (its app deleted, or redeployed with other router settings)
    goes; one asked for again is created again."""

    def __init__(self, forget_after_s: float = 60.0, settings: dict | None = None):
        super().__init__(forget_after_s, settings)
        exit_when_idle(min(5.0, forget_after_s / 4))

    async def exit_if_idle(self) -> None:
        if time.monotonic() - self.used_at >= self._forget_after_s:
            logger.info(f"TokenFlow state board: no push or poll for {self._forget_after_s:g} s; removing it")
            ray.actor.exit_actor()  # an intended exit: not restarted


StateBoardActor = ray.remote(num_cpus=0, max_restarts=-1)(DetachedBoard)


def get_board(app_name: str, shard: int = 0, settings: RoutingSettings | None = None):
    """Handle to one of the app's state boards for these router settings,
    created on first use."""
    return StateBoardActor.options(name=board_name(app_name, shard, settings), namespace=NAMESPACE,
                                   get_if_exists=True, lifetime="detached").remote(
        settings=settings.to_dict() if settings is not None else None)


def kill_named(prefix: str) -> int:
    """Kill every actor of TokenFlow's namespace whose name starts with `prefix`."""
    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry.get("name", "").startswith(prefix):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:
                pass
    return killed


def kill_app_actors(app_name: str) -> bool:
    """Remove the app's state boards, of any router settings."""
    return kill_named(board_prefix(app_name)) > 0


async def follow(app_name: str, shard: int, settings: RoutingSettings, on_snapshot, get=get_board) -> None:
    """Long-poll one state board for ever, handing each answer to
    on_snapshot(snapshot, shard). The board answers as soon as any of its
    engines pushes, so a state is as old as its transit, not a polling
    period; refresh_interval_s only bounds how often this loop asks (and
    paces retries). Never raises but CancelledError: routing falls back to
    Serve's default while no state arrives."""
    handle, failures, seen = None, 0, -1
    while True:
        started = time.monotonic()
        try:
            if handle is None:
                handle = await asyncio.to_thread(get, app_name, shard, settings)
                seen = -1
            poll = handle.wait_snapshot.remote(seen, 1.0)
            seen, snap = await asyncio.wait_for(poll, timeout=10.0)
            on_snapshot(snap, shard)
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep routing (by fallback) whatever happens here
            handle, failures = None, failures + 1
            if failures in (1, 10) or failures % 100 == 0:
                logger.warning(f"TokenFlow router: reading engine states (board {shard}) failed ({failures}x): {e!r}")
            await asyncio.sleep(1.0)
        await asyncio.sleep(max(0.0, settings.refresh_interval_s - (time.monotonic() - started)))
