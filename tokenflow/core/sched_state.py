"""What TokenFlow's scheduler tells the rest of the system, typed.

The scheduler fills a `SchedulerState` in the EngineCore process. It
crosses to the engine replica as a plain dict (an EngineCore utility call
goes over vLLM's msgpack channel, tokenflow/engine/core_utility.py) and is rebuilt
there with `from_wire`, so the engine agent, the router's summary and the
metrics read attributes, never string keys. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# The EngineCore utility's name (tokenflow/engine/core_utility.py).
UTILITY = "tokenflow_state"


@dataclass
class SchedulerStats:
    """Running totals since the engine started."""

    decisions: int = 0  # policy calls that changed something
    pauses_hold: int = 0  # pauses that kept the request's KV on the device
    pauses_release: int = 0  # pauses that freed it (vLLM's preemption)
    # Pauses decided but not applied: the request had finished, left
    # `running`, or was mid-prefill by the time the decision was applied.
    pauses_skipped: int = 0
    resumes: int = 0
    resumes_delayed: int = 0  # resumes put off a step: a step of the request was in flight
    pauses_in_flight: int = 0  # pauses applied while a step of the request was in flight
    fallbacks: int = 0  # decisions taken by the overload fallback (FCFS)
    decision_seconds: float = 0.0  # total time inside the policy
    max_running: int = 0  # most requests ever in `running` (<= max_num_seqs)
    max_blocks_used: int = 0  # most device KV blocks ever in use
    resumed_after_release: int = 0  # released requests that came back
    tokens_recomputed: int = 0  # KV recomputed on those resumes (not reloaded or cached)


@dataclass
class HostTierCounters:
    """The host KV tier (tokenflow/kv_offload/) of this engine, totals since start."""

    blocks_stored: int  # blocks written to the host pool
    blocks_loaded: int  # blocks read back to the device
    bytes_stored: int
    bytes_loaded: int
    evictions: int  # host blocks dropped to make room
    lookup_hits: int  # resumes that found their blocks on the host
    lookup_misses: int
    capacity_blocks: int  # size of this engine's share of the node's pool
    reloads_skipped: int = 0  # resumes sent to recompute although the host held their KV (prefill was faster)


@dataclass
class SchedulerState:
    """One engine's scheduler, now."""

    policy: str  # tokenflow | andes | fcfs
    running: int  # requests in vLLM's running queue
    waiting: int  # queued for admission, deferred ones included
    paused_hold: int  # paused with their KV on the device
    paused_release: int  # paused with their KV freed
    buffer_s_min: float | None  # smallest reader buffer of a running request (s); None: none has tokens yet
    buffer_s_sum: float  # their buffers together (s)
    buffer_s: list[float]  # each running request's buffer (s)
    required_rate: float  # tokens/s the readers of running and paused requests read
    decode_tps: float | None  # measured decode capacity (tokens/s); None until measured
    # Measured decode steps/s: the tokens/s one running request gets, so the
    # most any reader can use (None until measured). The router caps each
    # reader's stated rate at it, as the policy does.
    step_rate: float | None
    # The best step rate seen: the most one reader can get from this engine
    # at any load. The router caps each reader's stated rate at it; capped
    # at the step rate now, a full engine's readers sum to its throughput
    # however many they are, and a crowded engine looks no fuller than its
    # twin with fewer streams.
    peak_step_rate: float | None
    kv_free_blocks: int
    kv_total_blocks: int
    host_pool_blocks: int  # this engine's host KV share in blocks; 0 without a tier
    stats: SchedulerStats
    offload: HostTierCounters | None  # None without a host tier

    # Fields pushed with every engine state: what the router's ranking reads,
    # and the totals GET /v1/tokenflow/engines shows (benches record them).
    ROUTER_FIELDS = ("policy", "running", "waiting", "paused_hold", "paused_release", "buffer_s_min",
                     "buffer_s_sum", "required_rate", "step_rate", "kv_free_blocks", "kv_total_blocks", "host_pool_blocks",
                     "stats")

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict | None) -> "SchedulerState | None":
        """None for an empty answer (the engine runs another scheduler)."""
        if not d:
            return None
        offload = d.get("offload")
        return cls(**{**d, "stats": SchedulerStats(**d["stats"]),
                      "offload": HostTierCounters(**offload) if offload else None})

    def router_summary(self) -> dict:
        """Plain values (it goes out as JSON too)."""
        out = {name: getattr(self, name) for name in self.ROUTER_FIELDS}
        out["stats"] = asdict(self.stats)
        return out


assert {f.name for f in fields(SchedulerState)} >= set(SchedulerState.ROUTER_FIELDS)
