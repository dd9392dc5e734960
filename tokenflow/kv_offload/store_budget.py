"""How much write-through work one engine step may do, and for whom first.

vLLM's OffloadingConnector stores every newly full block of every scheduled
request at the next step. Under a burst (a wave of prompts) that is a lot of
copying at once; on the CPU backend the copies run inside the step, so the
step, and every reader's next token, waits for them. The paper sizes store
work to the step time and stores the requests likeliest to pause first.

Here: a token bucket fills at `share` x the measured store speed, so stores
take at most that share of the engine's time on average (at most
`max_credit_s` of saved-up work at once). Each step the credit goes to the
pending requests with the largest reader buffers first (TokenFlow pauses
those first, and a paused request whose blocks are stored reloads instead of
recomputing); the rest wait for a later step. Finished requests come last
(their blocks only serve prefix reuse).

Pure Python: tokenflow/kv_offload/connector.py applies the caps to vLLM's store path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PendingStore:
    req_id: str
    priority: float  # higher stores first: the reader's buffer in seconds
    next_chunk: int  # first chunk not stored yet
    pending: int  # chunks ready to store this step


@dataclass
class StoreBudget:
    share: float = 0.5  # of wall time the stores may use, on average
    max_credit_s: float = 0.1  # most store time saved up while idle
    credit_tokens: float = 0.0
    last: float | None = None
    deferred_chunks: int = 0  # chunks held back for a later step, since start

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"kv_offload: store_share must be in (0, 1], got {self.share!r}")
        if not self.max_credit_s > 0:
            raise ValueError(f"kv_offload: store_max_credit_s must be > 0, got {self.max_credit_s!r}")

    def refill(self, store_tps: float | None, now: float) -> bool:
        """Add the credit earned since the last step. False: no speed
        measured yet, so no cap (the first stores are what measure it)."""
        elapsed = 0.0 if self.last is None else max(0.0, now - self.last)
        self.last = now
        if not store_tps:
            return False
        rate = store_tps * self.share
        self.credit_tokens = min(self.credit_tokens + rate * elapsed, rate * self.max_credit_s)
        return True

    def allot(self, pending: list[PendingStore], tokens_per_chunk: int) -> dict[str, int]:
        """Spend the credit, largest buffers first. Returns, for each request
        that cannot store all it has pending, the chunk index to stop at."""
        left = int(self.credit_tokens // tokens_per_chunk)
        caps = {}
        # sorted() is stable: equal priorities keep vLLM's order.
        for p in sorted(pending, key=lambda p: -p.priority):
            take = min(p.pending, left)
            left -= take
            self.credit_tokens -= take * tokens_per_chunk
            if take < p.pending:
                caps[p.req_id] = p.next_chunk + take
                self.deferred_chunks += p.pending - take
        return caps
