"""An engine replica's view of its own streams, from what it sends out.

Pure Python (no Ray): TokenFlowLLMServer wraps each response generator with
`tracked()`, which feeds a tokenflow.core.buffer.ReaderBuffer per streaming
request; `EngineTracker.state()` summarises them for the router.

Tokens are counted from the chunks sent (sse.py): from per-chunk usage
where the stream carries it (read without parsing the chunk), else from
its content deltas.

A stream the ingress can continue elsewhere is also *movable*: `move()`
interrupts it while it waits for its next chunk (a paused reader's stream
waits seconds), and `tracked()` then closes its engine request and ends
with sse.moved_event(to), which the ingress answers with a continuation on
engine `to` (tokenflow/serve/routing/rebalance.py decides which go where).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import AsyncGenerator

from tokenflow.core.buffer import ReaderBuffer
from tokenflow.serve.sse import count_chunk, ids_in, latest_usage, moved_event


class Movable:
    """What move() needs of one movable stream, kept by tracked()."""

    __slots__ = ("task", "waiting", "moving")

    def __init__(self):
        self.task: asyncio.Task | None = None  # the task that awaits the stream's next chunk
        self.waiting = False  # awaiting it now (so a cancel lands inside the stream)
        self.moving: str | None = None  # the engine move() handed it to (and cancelled that wait)


class EngineTracker:
    """Open requests of one engine and its recent decode rate.

    `sink` (optional; tokenflow.serve.metrics.EngineMetrics in a replica) hears
    each request's first token, the gaps between its token-bearing chunks,
    its tokens and its end; a failing sink never disturbs a stream."""

    def __init__(self, horizon_s: float = 10.0, window_s: float = 2.0, clock=time.monotonic, sink=None):
        self.horizon_s = horizon_s
        self.window_s = window_s
        self.clock = clock
        self.sink = sink
        self._streams: dict[int, ReaderBuffer] = {}
        self._unary: set[int] = set()
        self._movable: dict[int, Movable] = {}
        self._next = 0
        self.received_total = 0
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self.peak_tps = 0.0
        self.slots: int | None = None  # the engine's max_num_seqs, once it runs (rebalance.py reads it)
        self.tokens_total = 0

    def open(self, rate: float, stream: bool, arrival: float, carried: tuple[float, float] | None = None) -> int:
        """`carried`: (unread tokens, seconds since the client sent it) of a
        stream continued from a lost engine, whose reader has begun."""
        self._next += 1
        self.received_total += 1
        if stream and carried is not None:
            self._streams[self._next] = ReaderBuffer.continued(rate, arrival, *carried)
        elif stream:
            self._streams[self._next] = ReaderBuffer(rate=rate, arrival_time=arrival)
        else:
            self._unary.add(self._next)
        return self._next

    def _tell(self, event: str, *args, **kwargs) -> None:
        if self.sink is None:
            return
        try:
            getattr(self.sink, event)(*args, **kwargs)
        except Exception:  # metrics must never break a stream
            pass

    def add_tokens(self, handle: int, n: int, now: float) -> None:
        if n <= 0:
            return
        reader = self._streams.get(handle)
        if reader is not None:
            if reader.first_token_time is None:
                self._tell("on_first_token", now - reader.arrival_time)
            elif reader.arrivals:  # not a continued stream's first tokens here
                self._tell("on_gap", now - reader.arrivals[-1])
            reader.on_tokens(now, n)
        self._window.append((now, n))
        self._window_tokens += n
        self.tokens_total += n  # exported as a counter by the agent's metrics sample

    @property
    def open_requests(self) -> int:
        """Requests open now, streams and whole ones."""
        return len(self._streams) + len(self._unary)

    def close(self, handle: int, now: float, status: str = "ok") -> None:
        """`status`: ok, error, cancelled or moved (for the finished-requests metric)."""
        reader = self._streams.pop(handle, None)
        self._movable.pop(handle, None)
        known = reader is not None or handle in self._unary
        self._unary.discard(handle)
        if known:
            self._tell("on_finish", reader, stream=reader is not None, status=status, now=now)

    def running_buffers(self, now: float) -> list[float]:
        """Buffered seconds of every stream that has had its first token."""
        return [r.buffer_seconds(now) for r in list(self._streams.values()) if r.first_token_time is not None]

    def idle_movable(self, now: float, quiet_s: float) -> list[tuple[int, ReaderBuffer]]:
        """Movable streams that have had tokens but none for quiet_s (their
        engine holds them paused) and wait for their next chunk now."""
        out = []
        for handle, m in list(self._movable.items()):
            reader = self._streams.get(handle)
            if (reader is not None and m.waiting and not m.moving and reader.arrivals
                    and now - reader.arrivals[-1] >= quiet_s):
                out.append((handle, reader))
        return out

    def move(self, handle: int, to: str) -> bool:
        """Interrupt a movable stream's wait for its next chunk: its
        tracked() ends it, handing it to engine `to`. False when it is not
        waiting."""
        m = self._movable.get(handle)
        if m is None or not m.waiting or m.moving or m.task is None or m.task.done():
            return False
        m.moving = to
        m.task.cancel()
        return True

    def decode_tps(self, now: float) -> float:
        while self._window and self._window[0][0] < now - self.window_s:
            self._window_tokens -= self._window.popleft()[1]
        tps = self._window_tokens / self.window_s
        self.peak_tps = max(self.peak_tps, tps)
        return tps

    def state(self, now: float | None = None, rate_cap: float | None = None) -> dict:
        """EngineState fields (without the ids) at `now`. `rate_cap`: the most
        tokens/s one stream gets from this engine (its best step rate); a reader
        that states more counts at that (the router must not see 10 readers
        at 10,000 tokens/s as 2,500 readers at 40)."""
        now = self.clock() if now is None else now
        cap = rate_cap if rate_cap and rate_cap > 0 else math.inf
        running = waiting = stalled = 0
        b_sum = b_cap = rate_sum = 0.0
        b_min = None
        for r in self._streams.values():
            rate = r.rate if r.rate < cap else cap
            rate_sum += rate
            if r.first_token_time is None:
                waiting += 1
                continue
            running += 1
            tokens = r.buffer(now)
            b = tokens / r.rate
            b_sum += b
            b_cap += min(tokens, rate * self.horizon_s)
            b_min = b if b_min is None else min(b_min, b)
            stalled += b <= 1e-9
        tps = self.decode_tps(now)
        return dict(running=running, waiting=waiting, unary=len(self._unary), stalled=stalled,
                    buffer_s_sum=round(b_sum, 4), buffered_capped=round(b_cap, 4),
                    buffer_s_min=None if b_min is None else round(b_min, 4),
                    rate_sum=rate_sum, decode_tps=round(tps, 2), peak_tps=round(self.peak_tps, 2),
                    received_total=self.received_total, slots=self.slots)


async def tracked(gen: AsyncGenerator, tracker: EngineTracker, *, rate: float, stream: bool,
                  arrival: float, use_usage: bool = True,
                  carried: tuple[float, float] | None = None, movable: bool = False) -> AsyncGenerator:
    """Yield what `gen` yields, counting its tokens into `tracker`.

    The request is opened when iteration starts (Serve starts it at once) and
    closed in `finally`, so a cancelled or failed stream never stays open.
    `movable`: move() may hand it to another engine (module doc)."""
    handle = tracker.open(rate, stream, arrival, carried)
    m = None
    if movable and stream:
        m = tracker._movable[handle] = Movable()
    counted = 0
    status = "cancelled"  # unless it ends normally or fails
    try:
        while True:
            if m is not None:
                # The task that awaits now is the one to cancel: Serve may
                # drive a stream from another task than the one that opened it.
                m.task, m.waiting = asyncio.current_task(), True
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                if m is None or not m.moving:
                    raise
                m.task.uncancel()  # the cancel was ours, and it ends here
                status = "moved"
                break
            finally:
                if m is not None:
                    m.waiting = False
            usage = latest_usage(item) if use_usage else None
            if usage is not None:  # exact, and no event needs parsing
                n = max(0, usage - counted)
            elif use_usage and (ids := ids_in(item)) is not None:  # as exact, as cheap
                n = ids
            else:
                n, usage = count_chunk(item)
                if use_usage and usage is not None and usage > counted + n:
                    n = usage - counted  # usage is exact; deltas only a lower bound
            if n:
                tracker.add_tokens(handle, n, tracker.clock())
                counted += n
            if getattr(item, "error", None) is not None:  # an ErrorResponse object
                status = "error"
            yield item
        if status == "moved":
            yield moved_event(m.moving)
        elif status != "error":
            status = "ok"
    except Exception:
        status = "error"
        raise
    finally:
        tracker.close(handle, tracker.clock(), status)
        # Close the inner stream now (not at garbage collection) so a client
        # that went away releases its engine request promptly.
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                pass
