"""The Serve request router that picks an engine by buffer slack.

Configured on the engine deployment as
`request_router_config.request_router_class` (tokenflow/serve/app.py does it
when `router.enabled`), so it runs inside every handle that calls the
engines, i.e. in each ingress replica.

Per request it only ranks a local table (ranking.py): background tasks
long-poll the app's state boards (board.py) for the engines with the most
slack (answered on each push), and sends made by this router count as load until
an engine's push reflects them. With no fresh state for any candidate (at
start, or when the board is unreachable) it falls back to Serve's default,
power of two choices.

Serve pickles the router class by value, so module-level state here would
not be shared with the ingress's HTTP handlers: what they share lives in
board.py (LOCAL_ROUTERS).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import List, Optional

from tokenflow.core.config import PIN_KEY, stated_rate
from tokenflow.serve.metrics import RouterMetrics
from tokenflow.serve.ray_private import PowerOfTwoChoicesRequestRouter
from tokenflow.serve.routing import board, ranking


class TokenFlowRequestRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._tf_settings = ranking.RoutingSettings.from_dict(kwargs)
        self._tf_table = ranking.RoutingTable(self._tf_settings)
        self._tf_candidates = ranking.CandidateIndex()
        # A send counts as load from its choice (_count_choice); per engine,
        # how many counted choices its on_send_request has yet to meet, and
        # the requests counted (a retry chooses again, and counts once).
        self._tf_expected: dict[str, int] = {}
        self._tf_counted: OrderedDict[str, str] = OrderedDict()
        self._tf_refresher: Optional[asyncio.Task] = None
        key = f"{self._deployment_id.app_name}/{self._deployment_id.name}#{id(self):x}"
        board.LOCAL_ROUTERS[key] = self._tf_table
        # Exported through Ray's metrics agent (ray_tokenflow_router_*; tokenflow/serve/metrics.py).
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
        # One long poll per state board (board.follow), all feeding the table.
        s = self._tf_settings
        await asyncio.gather(*(board.follow(self.app_name, shard, s, self._tf_table.update)
                               for shard in range(s.board_shards)))

    async def choose_replicas(self, candidate_replicas, pending_request=None) -> List[List]:
        start = time.perf_counter()
        table = self._table()
        order = None
        # LoRA requests keep Serve's multiplex-aware choice.
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            by_id = self._tf_candidates(candidate_replicas)
            pin = pinned(pending_request)
            order = [pin] if pin in by_id else table.rank(by_id)
        if order is None:
            ranks = await super().choose_replicas(candidate_replicas, pending_request)
            self._tf_record(table, start, None)
            return ranks
        # One rank per engine, best first: Serve tries the next one only if
        # the previous one refuses (its queue is full).
        self._tf_record(table, start, order[0])
        self._count_choice(table, pending_request, order[0])
        # Serve picks among a rank by queue length, from its cache or else by
        # probing the replica with a 0.1-1 s deadline, which a busy replica
        # misses (the request then waits in the router and retries): give
        # Serve the counts the engines' states already hold (docs/BENCHMARKS.md).
        cache = self.replica_queue_len_cache
        for e in order:
            cache.update(by_id[e].replica_id, table.queue_len(e))
        return [[by_id[e]] for e in order]

    def _count_choice(self, table: ranking.RoutingTable, pending_request, eid: str) -> None:
        """Count the request as sent to `eid` now. Serve sends it only once
        the caller's coroutine resumes (on_send_request), and in a burst the
        other requests' choices come first: counted only then, they all saw
        the same table and went to the same engine (docs/BENCHMARKS.md).
        Serve sends to the first choice unless it is full (one engine per
        rank); on_send_request corrects the count when it went elsewhere."""
        rid = getattr(getattr(pending_request, "metadata", None), "request_id", None)
        if rid is not None:
            if rid in self._tf_counted:  # a retry: counted at its first choice
                return
            self._tf_counted[rid] = eid
            if len(self._tf_counted) > COUNTED_KEPT:
                self._tf_counted.popitem(last=False)
        rate = stated_rate(pending_request.args[0], table.settings.rate) \
            if pending_request is not None and pending_request.args else None
        table.on_sent(eid, rate=rate)
        self._tf_expected[eid] = self._tf_expected.get(eid, 0) + 1

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
        if table is None:
            return
        eid = replica_id.unique_id
        if self._tf_expected.get(eid):
            self._tf_expected[eid] -= 1  # counted at its choice
            return
        # Sent where no choice counted it (its first choice was full): move a
        # count made elsewhere here, at the rate it counted at.
        other = next((e for e, n in self._tf_expected.items() if n), None)
        rate = None
        if other is not None:
            self._tf_expected[other] -= 1
            rate = table.withdraw(other)
        table.on_sent(eid, rate=rate)


# Requests whose choice was counted, remembered so that a retry counts once.
COUNTED_KEPT = 4096


def pinned(pending_request) -> Optional[str]:
    """The engine a request names in `tokenflow_engine` (the ingress's guard
    lets it through only when the app allows pinning); None for most."""
    args = getattr(pending_request, "args", None)
    extra = getattr(args[0], "model_extra", None) if args else None
    return extra.get(PIN_KEY) if extra else None
