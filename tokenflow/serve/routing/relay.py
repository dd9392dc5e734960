"""One relay per node between its engines and the state boards.

A state board's cost is per message (Ray's work for each actor call), not
per engine state in it (docs/SCALING.md). With `router.node_relay`, the
engines of a node push to their node's relay instead of a board, and the
relay forwards what has arrived as one `push_many` per board: at once when
it has been idle, then at most one message per `relay_interval_s` and
never two in flight to one board. A node's engines thus cost a board one
message per interval however many they are, a state waits at most that
interval, and when a board is slow the messages grow instead of its queue.

Like the boards, relays are detached named actors (one per app, router
settings and node, created by the first engine there): a redeploy with the
same settings finds and reuses them; they go with the Ray cluster, with
`kill_relays(app)`, or by themselves once no engine has pushed for a
minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import ray

from tokenflow.serve.idle import exit_when_idle
from tokenflow.serve.routing.board import NAMESPACE, get_board, kill_named, shard_of
from tokenflow.serve.routing.ranking import RoutingSettings

logger = logging.getLogger("ray.serve")


class Relay:
    """The relay's body: send(shard, states) delivers one message to a board."""

    def __init__(self, shard: int, send: Callable[[int, list[dict]], Awaitable[None]], min_gap_s: float = 0.0):
        # One board per relay: a node's engines all go to the board of its
        # node (board.shard_of(node id)), so a relay sends one message per
        # interval however many boards the app has.
        self._shard = shard
        self._send = send
        self._min_gap_s = min_gap_s
        self._waiting: dict[int, dict[str, dict]] = {}  # board -> engine id -> its latest state
        self._busy: set[int] = set()  # boards with a message in flight
        self.messages = 0
        self.states = 0

    def push(self, state: dict) -> None:
        shard = self._shard
        self._waiting.setdefault(shard, {})[state["engine_id"]] = state  # a newer state replaces an unsent one
        if shard not in self._busy:
            self._busy.add(shard)
            asyncio.get_running_loop().create_task(self._drain(shard))

    def discard(self, engine_id: str) -> None:
        """Drop an engine's unsent state (it is leaving the routing)."""
        self._waiting.get(self._shard, {}).pop(engine_id, None)

    async def _drain(self, shard: int) -> None:
        try:
            while self._waiting.get(shard):
                began = time.monotonic()
                batch = list(self._waiting.pop(shard).values())
                try:
                    await self._send(shard, batch)
                except Exception as e:  # the next pushes carry newer states anyway
                    logger.warning(f"TokenFlow relay: forwarding {len(batch)} states to board {shard} failed: {e!r}")
                    await asyncio.sleep(0.5)
                self.messages += 1
                self.states += len(batch)
                # Pushes that arrive meanwhile wait for the next message.
                await asyncio.sleep(max(0.0, self._min_gap_s - (time.monotonic() - began)))
        finally:
            self._busy.discard(shard)


class RelayActor:
    """A node's relay as a Ray actor, forwarding to the app's boards."""

    def __init__(self, app_name: str, node_id: str, settings: dict, idle_exit_s: float = 60.0):
        self._app = app_name
        self._settings = RoutingSettings.from_dict(settings)
        self._boards: dict[int, object] = {}
        self._shard = shard_of(node_id, self._settings.board_shards)
        self._relay = Relay(self._shard, self._send, self._settings.relay_interval_s)
        # Like a board, it removes itself once no engine has pushed for a
        # while (its app deleted, or redeployed with other router settings).
        self._idle_exit_s = idle_exit_s
        self._pushed_at = time.monotonic()
        exit_when_idle(min(5.0, idle_exit_s / 4))

    async def exit_if_idle(self) -> None:
        if time.monotonic() - self._pushed_at >= self._idle_exit_s:
            logger.info(f"TokenFlow relay: no push for {self._idle_exit_s:g} s; removing it")
            ray.actor.exit_actor()  # an intended exit: not restarted

    async def _board(self, shard: int):
        if shard not in self._boards:
            self._boards[shard] = await asyncio.to_thread(get_board, self._app, shard, self._settings)
        return self._boards[shard]

    async def _send(self, shard: int, states: list[dict]) -> None:
        board = await self._board(shard)
        try:
            await board.push_many.remote(states)
        except ray.exceptions.RayActorError:
            self._boards.pop(shard, None)  # gone for good: look it up (recreate it) next time
            raise

    @ray.method(enable_task_events=False)
    async def push(self, state: dict) -> None:
        self._relay.push(state)
        self._pushed_at = time.monotonic()

    async def forget(self, engine_id: str) -> None:
        self._relay.discard(engine_id)
        board = await self._board(self._shard)
        await board.forget.remote(engine_id)

    async def stats(self) -> dict:
        return {"messages": self._relay.messages, "states": self._relay.states, "board": self._shard,
                "running_on": ray.get_runtime_context().get_node_id()}


RelayActorRemote = ray.remote(num_cpus=0, max_restarts=-1)(RelayActor)


def relay_prefix(app_name: str) -> str:
    return f"tokenflow-relay:{app_name or 'default'}@"


def relay_name(app_name: str, node_id: str, settings: RoutingSettings) -> str:
    """Named by app, router settings (a digest, as the boards) and node."""
    return f"{relay_prefix(app_name)}{settings.fingerprint()}:{node_id}"


def get_relay(app_name: str, node_id: str, settings: RoutingSettings):
    """Handle to the app's relay on that node, created there on first use."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return RelayActorRemote.options(
        name=relay_name(app_name, node_id, settings), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached", scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(app_name, node_id, settings.to_dict())


def kill_relays(app_name: str) -> int:
    """Remove the app's relays, of any router settings, on every node."""
    return kill_named(relay_prefix(app_name))
