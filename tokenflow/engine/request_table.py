"""Each live request's fixed facts in a row of arrays.

A decision reads, for every live request, its arrival, its reader's rate,
its max_tokens and its prompt's length. None of them changes while the
request lives, so they are written once, when vLLM adds the request, and a
decision gathers each with one array index instead of touching hundreds of
Request and ReaderBuffer objects (docs/BENCHMARKS.md, "Policy decision
time").
"""

from __future__ import annotations

import numpy as np


class RequestTable:
    def __init__(self, capacity: int = 256):
        self.row_of: dict[str, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.arrival_time = np.zeros(capacity)
        self.rate = np.ones(capacity)
        self.max_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_prompt = np.zeros(capacity, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, req_id: str, arrival_time: float, rate: float, max_tokens: int, num_prompt: int) -> None:
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self.row_of[req_id] = self._free.pop()
        self.arrival_time[row], self.rate[row] = arrival_time, rate
        self.max_tokens[row], self.num_prompt[row] = max_tokens, num_prompt

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def rows(self, req_ids: list[str]) -> np.ndarray:
        """The rows of `req_ids` (each must be in the table)."""
        return np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.intp, count=len(req_ids))

    def _grow(self) -> None:
        n = len(self.rate)
        self._free.extend(range(2 * n - 1, n - 1, -1))
        self.arrival_time = np.concatenate((self.arrival_time, np.zeros(n)))
        self.rate = np.concatenate((self.rate, np.ones(n)))
        self.max_tokens = np.concatenate((self.max_tokens, np.zeros(n, dtype=np.int64)))
        self.num_prompt = np.concatenate((self.num_prompt, np.zeros(n, dtype=np.int64)))
