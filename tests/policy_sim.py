"""A tiny discrete-time engine for exercising policies with an injected
clock: each step lasts 1/step_rate s and gives every running request one
token; waiting requests admitted take one step of prefill (their first
token). KV is counted in blocks of `block_size` tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenflow.core.buffer import ReaderBuffer
from tokenflow.core.policy import EngineView, Phase, RequestView


@dataclass
class SimRequest:
    req_id: str
    arrival: float
    rate: float
    prompt: int
    max_tokens: int
    phase: Phase = Phase.WAITING
    resident: bool = False
    out: int = 0
    reader: ReaderBuffer = None  # type: ignore[assignment]
    paused_since: float | None = None

    def __post_init__(self):
        self.reader = ReaderBuffer(rate=self.rate, arrival_time=self.arrival)


@dataclass
class SimEngine:
    policy: object
    total_blocks: int
    max_num_seqs: int
    block_size: int = 16
    step_rate: float = 50.0
    dt: float = 0.5
    now: float = 0.0
    reqs: dict[str, SimRequest] = field(default_factory=dict)
    done: list[SimRequest] = field(default_factory=list)
    max_blocks_used: int = 0
    pauses: int = 0
    deferred: set[str] = field(default_factory=set)  # out of the queue until the next decision

    def blocks(self, r: SimRequest) -> int:
        return math.ceil((r.prompt + r.out + 1) / self.block_size)

    def used(self) -> int:
        return sum(self.blocks(r) for r in self.reqs.values() if r.resident)

    def view(self) -> tuple[list[RequestView], EngineView]:
        views = [
            RequestView(r.req_id, r.phase, r.arrival, r.rate, r.reader.buffer(self.now), r.out,
                        r.max_tokens, r.prompt + r.out, self.blocks(r), r.resident)
            for r in self.reqs.values()
        ]
        eng = EngineView(self.block_size, self.total_blocks, self.total_blocks - self.used(),
                         self.max_num_seqs, decode_tps=None, step_rate=self.step_rate,
                         prefill_tps=20_000.0, transfer_tps=None)
        return views, eng

    def decide(self):
        views, eng = self.view()
        d = self.policy.decide(views, eng)
        self.deferred = set(d.defer) if d is not None else set()
        if d is None:
            return None
        for i in d.pause_hold + d.pause_release:
            r = self.reqs[i]
            if r.phase == Phase.RUNNING:
                self.pauses += 1
                r.paused_since = self.now
            r.phase = Phase.PAUSED
            r.resident = i in d.pause_hold and r.resident
        for i in d.run + d.admit:
            r = self.reqs[i]
            r.phase = Phase.RUNNING
            r.resident = True
            r.paused_since = None
        return d

    def admit(self):
        """Like vLLM between decisions: waiting requests start in arrival
        order while sequence slots and KV blocks last."""
        running = sum(1 for r in self.reqs.values() if r.phase == Phase.RUNNING)
        for r in sorted(self.reqs.values(), key=lambda r: r.arrival):
            if r.phase != Phase.WAITING or r.req_id in self.deferred:
                continue
            if running >= self.max_num_seqs or self.used() + self.blocks(r) > self.total_blocks:
                break
            r.phase, r.resident = Phase.RUNNING, True
            running += 1

    def step(self):
        self.admit()
        self.now += 1.0 / self.step_rate
        for r in list(self.reqs.values()):
            if r.phase != Phase.RUNNING:
                continue
            r.out += 1
            r.reader.on_tokens(self.now)
            if r.out >= r.max_tokens:
                r.reader.on_finish(self.now)
                del self.reqs[r.req_id]
                self.done.append(r)
        # Like vLLM: out of blocks, the last running request is preempted.
        running = [r for r in self.reqs.values() if r.phase == Phase.RUNNING]
        while self.used() > self.total_blocks and running:
            victim = running.pop()
            victim.phase, victim.resident = Phase.WAITING, False
        self.max_blocks_used = max(self.max_blocks_used, self.used())

    def run(self, until: float):
        next_decision = 0.0
        while self.now < until and self.reqs:
            if self.now >= next_decision:
                self.decide()
                next_decision = self.now + self.dt
            self.step()
