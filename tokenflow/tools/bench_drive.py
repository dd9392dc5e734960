"""One vLLM engine driven through a bench workload, a turn at a time.

A turn adds the requests that have arrived, then runs one engine step (or
waits for the next arrival). Turns are timed by a clock:
- `WallClock`: the engine has the machine to itself (`tokenflow bench`'s
  default, one scheduler after another);
- `WorkClock`: several engines in one process take turns, a step each
  (`tokenflow bench --lockstep`). An engine's clock runs only while it
  works (adds, steps) and jumps ahead when it waits for its next arrival,
  so each engine lives on its own timeline as if it were alone, and a
  machine that slows down for a while slows every engine's steps alike.
"""

from __future__ import annotations

import time

from tokenflow.core.buffer import ReaderBuffer


class WallClock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def work(self, fn):
        return fn()

    def wait_until(self, t: float) -> None:
        time.sleep(min(0.01, max(0.0, t - self.now())))


class WorkClock:
    """Seconds of this engine's own work (and waits for arrivals)."""

    def __init__(self) -> None:
        self.elapsed = 0.0
        self._since: float | None = None  # perf_counter at the start of the work under way

    def now(self) -> float:
        # Inside work() the clock runs with the wall: the scheduler reads it
        # at both ends of a step to time it.
        return self.elapsed if self._since is None else self.elapsed + time.perf_counter() - self._since

    def work(self, fn):
        self._since = time.perf_counter()
        try:
            return fn()
        finally:
            self.elapsed = self.now()
            self._since = None

    def wait_until(self, t: float) -> None:
        self.elapsed = max(self.elapsed, t)


class EngineRun:
    """The workload's requests through one LLMEngine; a reader per request
    times its tokens on the run's clock."""

    def __init__(self, engine, wl, clock) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.wl, self.clock = engine, wl, clock
        self._params = lambda rate: SamplingParams(temperature=0, max_tokens=wl.output_tokens, ignore_eos=True,
                                                   output_kind=RequestOutputKind.DELTA,
                                                   extra_args={"consumption_rate": rate})
        self.arrivals, self.rates, self.prompts = wl.arrivals(), wl.reading_rates(), wl.prompts()
        self.readers: dict[str, ReaderBuffer] = {}
        self.finished: set[str] = set()
        self.next = 0  # the next request to arrive

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.wl.requests

    def turn(self) -> None:
        self.clock.work(self._admit)
        if not self.engine.has_unfinished_requests():
            if self.next < self.wl.requests:
                self.clock.wait_until(self.arrivals[self.next])
            return
        outs = self.clock.work(self.engine.step)
        now = self.clock.now()
        for o in outs:
            reader = self.readers[o.request_id]
            reader.on_tokens(now, len(o.outputs[0].token_ids) if o.outputs else 0)
            if o.finished:
                reader.on_finish(now)
                self.finished.add(o.request_id)

    def _admit(self) -> None:
        n, now = self.wl.requests, self.clock.now()
        while self.next < n and self.arrivals[self.next] <= now:
            i, rid = self.next, f"req-{self.next}"
            self.readers[rid] = ReaderBuffer(rate=self.rates[i], arrival_time=max(self.arrivals[i], 0.0))
            self.engine.add_request(rid, {"prompt_token_ids": self.prompts[i]}, self._params(self.rates[i]))
            self.next += 1

    def records(self, wall: float) -> list[dict]:
        return [
            {"id": rid, "rate": r.rate, "arrival_s": r.arrival_time, "ttft_s": r.ttft, "tokens": r.delivered,
             "stall_s": r.stall_time(wall), "effective_tokens": r.effective_tokens(), "qoe": r.qoe(),
             "arrivals_s": r.arrivals}
            for rid, r in self.readers.items()
        ]
