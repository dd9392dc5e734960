"""What the policy sees of each live request: one `RequestView`, or every
request at once as `RequestColumns`, one array per field.

The policy decides over columns: at 400 requests a decision is a few dozen
array operations instead of a Python loop that touches every request three
times (snapshot, rank, apply: docs/BENCHMARKS.md, "Policy decision time").
`RequestView` stays for people and tests: one request, named fields, and
`RequestColumns.of` turns a list of them into columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class Phase(str, Enum):
    WAITING = "waiting"  # not admitted yet (new, or released and queued)
    RUNNING = "running"
    PAUSED = "paused"  # parked by us; `kv_resident` says whether it kept its KV


# Phase codes in RequestColumns.phase.
WAITING, RUNNING, PAUSED = 0, 1, 2
PHASE_CODE = {Phase.WAITING: WAITING, Phase.RUNNING: RUNNING, Phase.PAUSED: PAUSED}
PHASE_OF_CODE = {code: phase for phase, code in PHASE_CODE.items()}


@dataclass(slots=True)
class RequestView:
    req_id: str
    phase: Phase
    arrival_time: float
    rate: float  # reader's tokens/s
    buffer_tokens: float  # delivered but unread now
    num_output: int  # tokens generated so far
    max_tokens: int
    num_tokens: int  # context length: prompt + generated
    blocks: int  # KV blocks it needs resident to run
    kv_resident: bool = False  # its blocks are on the accelerator now
    host_blocks: int = 0  # of its blocks, how many the host tier holds
    # Its reader has begun and reads from its buffer while it waits: a
    # stream continued from a lost engine, or one vLLM preempted.
    reading: bool = False

    @property
    def buffer_s(self) -> float:
        return self.buffer_tokens / self.rate


@dataclass
class RequestColumns:
    """Every live request, row i of each array being request `ids[i]`; the
    fields mean what RequestView's do. Rows keep the order given (the
    policy's sorts are stable: equal keys keep it)."""

    ids: list[str]
    phase: np.ndarray  # int8: WAITING, RUNNING or PAUSED
    arrival_time: np.ndarray  # float64
    rate: np.ndarray  # float64
    buffer_tokens: np.ndarray  # float64
    num_output: np.ndarray  # int64
    max_tokens: np.ndarray  # int64
    num_tokens: np.ndarray  # int64
    blocks: np.ndarray  # int64
    kv_resident: np.ndarray  # bool
    host_blocks: np.ndarray  # int64
    reading: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, views: list[RequestView]) -> "RequestColumns":
        def col(name, dtype):
            return np.array([getattr(v, name) for v in views], dtype=dtype)

        return cls(ids=[v.req_id for v in views],
                   phase=np.array([PHASE_CODE[Phase(v.phase)] for v in views], dtype=np.int8),
                   arrival_time=col("arrival_time", np.float64), rate=col("rate", np.float64),
                   buffer_tokens=col("buffer_tokens", np.float64), num_output=col("num_output", np.int64),
                   max_tokens=col("max_tokens", np.int64), num_tokens=col("num_tokens", np.int64),
                   blocks=col("blocks", np.int64), kv_resident=col("kv_resident", bool),
                   host_blocks=col("host_blocks", np.int64), reading=col("reading", bool))

    def view(self, i: int) -> RequestView:
        return RequestView(self.ids[i], PHASE_OF_CODE[int(self.phase[i])], float(self.arrival_time[i]),
                           float(self.rate[i]), float(self.buffer_tokens[i]), int(self.num_output[i]),
                           int(self.max_tokens[i]), int(self.num_tokens[i]), int(self.blocks[i]),
                           bool(self.kv_resident[i]), int(self.host_blocks[i]), bool(self.reading[i]))

    def views(self) -> list[RequestView]:
        return [self.view(i) for i in range(len(self.ids))]
