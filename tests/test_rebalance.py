"""Moving paused streams off a busy engine (tokenflow/serve/routing/rebalance.py).

The policy on engine states; the replica's side on a real asyncio stream
(a paused stream interrupted while it waits for its next chunk, its engine
request closed, the hand-over named in its last item); the ingress
continuing a move on the engine named; and, live, a burst piled onto one
engine, with streams that ask to stay and then with movable ones."""

from __future__ import annotations

import asyncio
import os

import pytest

from tokenflow.serve.failover import MOVED, EngineLost, loss_cause, relay
from tokenflow.serve.routing.ranking import EngineState, RoutingSettings
from tokenflow.serve.routing.rebalance import Idle, plan_moves
from tokenflow.serve.sse import moved_event
from tokenflow.serve.streams import EngineTracker, tracked

S = RoutingSettings(capacity_tps=1000.0, rebalance_min_buffer_s=1.0)


def state(eid: str, rate_sum: float, load: int, peak: float = 1000.0, waiting: int = 0,
          stream_tps: float | None = 50.0, slots: int | None = None):
    return EngineState(engine_id=eid, rate_sum=rate_sum, running=load - waiting, waiting=waiting, peak_tps=peak,
                       stream_tps=stream_tps, slots=slots)


def paused(n: int, rate: float = 10.0, first_buffer: float = 2.0) -> list[Idle]:
    return [Idle(h, rate, first_buffer + h) for h in range(n)]


def test_paused_streams_go_downhill_until_the_loads_are_level():
    own = state("a", 600.0, load=60)
    # b runs 50: moves while a stays more loaded than b (60-55 vs 50-55),
    # the streams with the most text in hand first.
    assert plan_moves(own, [state("b", 500.0, load=50)], paused(28), S) == [(h, "b") for h in (27, 26, 25, 24, 23)]
    # Level already: nothing moves, so two engines never trade streams back.
    assert plan_moves(own, [state("b", 500.0, load=59)], paused(28), S) == []
    assert plan_moves(own, [], paused(28), S) == []
    # Two peers: the least loaded takes each next one, until a is down to
    # the level of the least loaded (35 each; b at 40 gets none).
    moves = plan_moves(own, [state("b", 400.0, load=40), state("c", 100.0, load=10)], paused(28), S)
    assert [to for _, to in moves] == ["c"] * 25
    moves = plan_moves(state("a", 600.0, load=60), [state("b", 300.0, load=30), state("c", 300.0, load=31)],
                       paused(28), S)
    assert [to for _, to in moves] == ["b", "c", "b", "c", "b", "c", "b", "c", "b", "c", "b", "c", "b", "c", "b", "c",
                                       "b", "c", "b"]


def test_the_streams_with_most_text_in_hand_go_first_and_none_too_dry_to_move():
    own = state("a", 600.0, load=60)
    idle = [Idle(1, 10.0, 9.0), Idle(2, 10.0, 2.0), Idle(3, 10.0, 0.5), Idle(4, 10.0, 3.0)]
    # Stream 3 has too little text left to survive the move; the others can
    # wait out the hand-over, the best stocked most easily.
    assert [h for h, _ in plan_moves(own, [state("b", 0.0, load=0)], idle, S)] == [1, 4, 2]
    # Only two fit (b has two free slots): the two best stocked go.
    assert [h for h, _ in plan_moves(own, [state("b", 0.0, load=30, slots=32)], idle, S)] == [1, 4]


def test_a_peer_takes_streams_only_into_free_slots():
    own = state("a", 600.0, load=60)
    # Levelling alone would move 15 to b (45 each); b has 2 free slots.
    assert len(plan_moves(own, [state("b", 300.0, load=30, slots=32)], paused(28), S)) == 2
    assert plan_moves(own, [state("b", 300.0, load=32, slots=32)], paused(28), S) == []
    # A full peer is skipped, a peer with room still takes its share.
    moves = plan_moves(own, [state("b", 300.0, load=32, slots=32), state("c", 300.0, load=28, slots=32)],
                       paused(28), S)
    assert [to for _, to in moves] == ["c"] * 4
    # Slots not known (an engine that did not say): levelling alone.
    assert len(plan_moves(own, [state("b", 300.0, load=30)], paused(28), S)) == 15


def test_moves_are_bounded_by_the_peers_spare_rate_and_skip_peers_with_a_queue():
    own = state("a", 1400.0, load=60)
    # b has 25 tokens/s to spare: two readers of 10, not three; c has a queue.
    assert plan_moves(own, [state("b", 975.0, load=5), state("c", 0.0, load=3, waiting=3)], paused(10), S) == [
        (9, "b"), (8, "b")]


def test_a_reader_faster_than_the_engine_counts_at_the_engine_s_step_rate():
    own = state("a", 600.0, load=30, stream_tps=20.0)
    # Its reader states 500 tokens/s, but one stream gets only 20 here.
    assert plan_moves(own, [state("b", 975.0, load=1)], [Idle(1, 500.0, 3.0)], S) == [(1, "b")]


def paused_engine_stream(closed: list):
    """An engine's response stream: one chunk, then paused (no chunk) until closed."""
    async def gen():
        try:
            yield 'data: {"choices":[{"text":"a"}],"usage":{"completion_tokens":30}}\n\n'
            await asyncio.sleep(3600)
            yield 'data: {"choices":[{"text":"b"}],"usage":{"completion_tokens":31}}\n\n'
        finally:
            closed.append(True)
    return gen()


def test_a_paused_movable_stream_is_interrupted_and_ends_with_the_moved_event():
    async def main():
        now = [100.0]
        tracker = EngineTracker(clock=lambda: now[0])
        closed = []

        async def consume(movable: bool) -> list:
            got = []
            async for item in tracked(paused_engine_stream(closed), tracker, rate=10.0, stream=True,
                                      arrival=tracker.clock(), movable=movable):
                got.append(item)
            await asyncio.sleep(0)  # the task was not left cancelled: it goes on
            return got

        movable = asyncio.create_task(consume(True))
        fixed = asyncio.create_task(consume(False))
        await asyncio.sleep(0.05)
        assert tracker.idle_movable(now[0], 0.5) == []  # it had tokens just now
        now[0] += 1.0
        idle = tracker.idle_movable(now[0], 0.5)
        assert len(idle) == 1  # the other stream is not movable
        handle, reader = idle[0]
        assert reader.rate == 10.0 and reader.buffer_seconds(now[0]) == pytest.approx(2.0)
        assert tracker.move(handle, "b") and not tracker.move(handle, "b")
        got = await asyncio.wait_for(movable, 5)
        assert len(got) == 2 and got[-1] == moved_event("b")  # its chunk, then the hand-over to b
        assert closed == [True]  # the engine request was closed
        assert tracker.state()["running"] == 1  # only the other stream is open
        fixed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fixed
        assert closed == [True, True] and tracker.state()["running"] == 0

    asyncio.run(main())


A = 'data: {"choices":[{"text":"a"}]}\n\n'
B = 'data: {"choices":[{"text":"b"}]}\n\n'


def test_a_move_is_continued_on_the_engine_named_and_counted_as_a_rebalance():
    def first(batched: bool):
        async def gen():
            yield A
            yield [A, moved_event("b")] if batched else moved_event("b")
            yield B  # never read: the stream was handed over
        return gen

    def rest():
        async def gen():
            yield B
        return gen()

    for batched in (False, True):
        seen, asked = [], []

        def continue_after(to):
            asked.append(to)
            return rest

        async def collect():
            # The wait a loss gets (for the routing to hear of it) does not
            # apply: the engine named is alive.
            return [x async for x in relay(first(batched), 2, lambda o, c: seen.append((o, c)),
                                           resend_after_s=60.0, continue_after=continue_after)]
        assert asyncio.run(asyncio.wait_for(collect(), 10)) == ([A, A, B] if batched else [A, B])
        assert seen == [("continued", "rebalance")] and asked == ["b"]
    assert loss_cause(EngineLost(MOVED)) == "rebalance"


def test_a_continuation_to_an_engine_is_pinned_there():
    from tests.test_continuation import PROMPT, completion_chunk, completions_body

    from tokenflow.serve.continuation import Ledger
    from tokenflow.serve.routing.request_router import pinned

    ledger = Ledger(completions_body(), "completions", default_rate=40)
    ledger._note(completion_chunk("cmpl-1", " the", [7], prompt=PROMPT))
    req = ledger.continuation("b")
    assert req.model_extra["tokenflow_engine"] == "b"

    class Pending:  # what Serve hands choose_replicas: the call's arguments
        args = [req, None]
    assert pinned(Pending()) == "b"
    assert ledger.continuation().model_extra.get("tokenflow_engine") is None  # a failure's goes anywhere


# --- live: a burst piled onto one engine -------------------------------------------

# The skewed burst: every stream pinned to one engine (the other idle), as
# many as one ingress admits here (64), nearly twice its slots (32). Slow
# readers, so buffers build and the engine pauses readers to let the
# queued ones start.
SKEW_STREAMS = 60
SKEW_RATE = 10
SKEW_TOKENS = 200


def _skewed_round(base: str, model: str, target: str, rate: float, movable: bool, http):
    """One burst pinned to `target`: (stream records, the engines' view
    before and after, the most tokens/s `target` reported delivering)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_failover import _engines, _stream

    before = _engines(base, http)
    bodies = [{"model": model, "prompt": f"Rebalance {i}: the lighthouse and the sea", "max_tokens": SKEW_TOKENS,
               "ignore_eos": True, "temperature": 0, "consumption_rate": rate, "tokenflow_engine": target,
               "tokenflow_rebalance": movable} for i in range(SKEW_STREAMS)]
    done, peak = threading.Event(), [0.0]

    def watch():
        while not done.wait(0.5):
            rows = [e for e in _engines(base, http)["engines"] if e["engine_id"] == target]
            peak[0] = max([peak[0]] + [e["decode_tps"] for e in rows])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(SKEW_STREAMS) as pool:
            records = list(pool.map(lambda b: _stream(base, b, None, http), bodies))
    finally:
        done.set()
        watcher.join()
    for r in records:
        r["ttft_s"] = r["times"][0][0] - t0 if r["times"] else None
    return records, before, _engines(base, http), peak[0]


def _wait_idle(base: str, http, timeout: float = 120.0) -> None:
    import time

    from tests.test_failover import _engines

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = _engines(base, http)["engines"]
        if engines and all(e["running"] + e["waiting"] + e["unary"] == 0 for e in engines):
            return
        time.sleep(0.5)
    raise AssertionError("the engines did not go idle")


@pytest.mark.slow
def test_a_skewed_burst_moves_paused_streams_to_the_idle_engine(serve_app):
    """A burst piled onto one engine, twice. First every stream asks to stay
    (`tokenflow_rebalance: false`), so its engine may not move any: the
    negative control. Then the same streams, movable: the busy engine moves
    paused ones to the idle engine (counted as rebalances, received there),
    and every stream still reads exactly the uninterrupted greedy text (the
    first round's), one id, the whole usage, [DONE], no error event. Both
    rounds' figures are printed; `tokenflow bench-rebalance` measures the
    difference over rounds (docs/BENCHMARKS.md)."""
    from tests.test_failover import _burst_client, _stall_s, _wait_engines

    base, model = serve_app["base_url"], serve_app["model"]
    engines = _wait_engines(base, 2, timeout=300)
    # Each engine tells its peers its slots (vLLM's max_num_seqs): moves fill only free ones.
    assert {e["slots"] for e in engines} == {_max_num_seqs()}, engines
    target, other = sorted(e["engine_id"] for e in engines)[:2]
    http = _burst_client(base)
    figures, texts = {}, None
    for label, movable in (("asked to stay", False), ("movable", True)):
        _wait_idle(base, http)
        records, before, after, delivered = _skewed_round(base, model, target, SKEW_RATE, movable, http)
        broken = [(i, r["status"], r["errors"], r["done"], r["tokens"], len(r["ids"])) for i, r in enumerate(records)
                  if r["status"] != 200 or r["errors"] or not r["done"] or r["tokens"] != SKEW_TOKENS
                  or len(r["ids"]) != 1]
        assert not broken, (label, broken)
        moved = after["replicas_lost_by_cause"]["rebalance"] - before["replicas_lost_by_cause"]["rebalance"]
        taken = _received(after, other) - _received(before, other)
        stalls = [_stall_s(r, 0.0, SKEW_RATE) for r in records]
        figures[label] = {"delivered_tps": round(delivered), "moved": moved, "taken_by_other": taken,
                          "stall_s_total": round(sum(stalls), 2), "stall_s_max": round(max(stalls), 2),
                          "stalled_readers": sum(s > 0.5 for s in stalls),
                          "ttft_s_max": round(max(r["ttft_s"] for r in records), 2)}
        if texts is None:
            texts = [r["text"] for r in records]
            assert moved == 0 and taken == 0, f"streams that asked to stay were moved: {figures}"
        else:
            assert moved >= 1 and taken >= moved, f"no stream moved off the busy engine: {figures}"
            wrong = [(i, len(os.path.commonprefix((r["text"], t))), len(t))
                     for i, (r, t) in enumerate(zip(records, texts)) if r["text"] != t]
            # (stream, first character that differs, length): where a splice went wrong, or a near tie flipped
            assert not wrong, f"moved streams whose text is not the uninterrupted answer: {wrong}"
    print(f"\nskewed burst of {SKEW_STREAMS} streams of {SKEW_TOKENS} tokens, readers at {SKEW_RATE} tokens/s, "
          f"on one engine: {figures}")


def _max_num_seqs() -> int:
    import yaml

    from tests.conftest import TEST_CONFIG

    with open(TEST_CONFIG) as f:
        return yaml.safe_load(f)["applications"][0]["args"]["engine_kwargs"]["max_num_seqs"]


def _received(view: dict, engine_id: str) -> int:
    return next(e["received_total"] for e in view["engines"] if e["engine_id"] == engine_id)
