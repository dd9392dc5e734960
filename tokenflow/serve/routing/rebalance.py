"""Moving paused streams off a busy engine to less loaded ones.

The slack router places each request where slack is largest when it
arrives, but it cannot know how long each answer will run: a burst of long
answers can pile onto one engine while short ones leave another idle. The
busy engine then time-shares its slots among more readers than it can
serve at once (its readers stall in turn), and no new request fixes that. So each engine looks at itself every
`rebalance_interval_s`. Paused streams mean it is short of room: the
TokenFlow policy pauses a reader only when newcomers need its slot or the
engine cannot keep up with every reader at once. While it holds paused
streams, and peers (from the state boards' head: the engines with the
most slack) have nobody queued, a free slot and spare rate, it moves
paused streams there, each to the least loaded such peer, for as long as
that leaves it more loaded than that peer (so streams only ever go
downhill, and two engines never trade them back and forth).

Which streams: most buffered seconds first. A move costs its reader a gap
(the continuation's prefill on the peer, with the other streams moved in
the same round), so it goes to the readers with the most text in hand;
the readers about to run dry stay, and their engine, now less loaded,
resumes them in place. None is moved with less than
`rebalance_min_buffer_s` in hand. A peer takes streams only into free
slots (its `slots` less its load): a stream moved onto a full peer would
only wait paused there instead (the first version levelled by load alone,
and the peer ended up time-sharing more streams than its slots).

Moving is the ingress's continuation (tokenflow/serve/continuation.py):
the replica interrupts the paused stream and names the peer; the ingress
continues the stream there (the router's own ranking, which counts decode
rate but not slots, would often send it straight back). Two busy engines
may count on the same peer in one round; its next push shows what it
took, and their next rounds see that.

Pure Python: the engine agent (agent.py) supplies the states and the
streams and carries the moves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow.serve.routing.ranking import EngineState, RoutingSettings, peer_tps

# A stream that has had no token for this long is held paused by its engine
# (a running one gets a chunk every step, and a step of a busy CPU engine
# takes well under this).
QUIET_S = 0.5


@dataclass(frozen=True)
class Idle:
    """A movable stream its engine holds paused."""

    handle: int  # the replica's stream handle (streams.EngineTracker)
    rate: float  # its reader's tokens/s
    buffer_s: float  # seconds of text its reader has not read yet


def required(st: EngineState, s: RoutingSettings) -> float:
    """Tokens/s an engine's readers need (running, paused and queued)."""
    return st.rate_sum + st.unary * s.rate


def capacity(st: EngineState, s: RoutingSettings, best_tps: float) -> float:
    """Tokens/s an engine decodes, as ranking.slack counts it."""
    return max(st.peak_tps, best_tps, s.capacity_tps)


def plan_moves(own: EngineState, peers: list[EngineState], idle: list[Idle],
               s: RoutingSettings) -> list[tuple[int, str]]:
    """(handle, engine id) of each stream to move now, and where (module doc)."""
    best = peer_tps([own, *peers])
    room = {p.engine_id: [capacity(p, s, best) - required(p, s), p.load, p.slots or math.inf] for p in peers
            if p.engine_id != own.engine_id and p.waiting == 0}
    load, moves = own.load, []
    for stream in sorted(idle, key=lambda x: -x.buffer_s):
        if stream.buffer_s < s.rebalance_min_buffer_s:
            break  # the rest hold less still
        need = min(stream.rate, own.stream_tps) if own.stream_tps else stream.rate
        fits = [e for e, (spare, peer_load, slots) in room.items()
                if spare >= need and peer_load < min(load - 1, slots)]
        if not fits:
            break
        target = min(fits, key=lambda e: (room[e][1], -room[e][0], e))
        room[target][0] -= need
        room[target][1] += 1
        load -= 1
        moves.append((stream.handle, target))
    return moves
