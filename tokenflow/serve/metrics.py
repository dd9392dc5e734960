"""TokenFlow's Prometheus metrics: every definition, in one place.

They are Ray metrics (ray.util.metrics), recorded inside the Serve replica
processes (engine replicas and the ingress's request router) and exported by
each Ray node's metrics agent, so one Prometheus scrape of the cluster (via
Ray's service discovery file, configs/prometheus.yml) sees every replica.
The agent prefixes every name with `ray_`; Prometheus then sees a counter
`tokenflow_x` as `ray_tokenflow_x_total` and a histogram as
`ray_tokenflow_x_bucket/_sum/_count` (`Spec.exported()` gives the real names).
vLLM's own metrics keep their names (`ray_vllm_*`).

Engine metrics carry vLLM's own labels, `model_name` and `ReplicaId` (the
Serve replica's id, which the router uses too), so they join vLLM's
`ray_vllm_*` series of the same replica as they are. What feeds them:

- per request (tokenflow/serve/llm_server.py through tokenflow/serve/streams.py), from
  the chunks the replica sends and the replica's ReaderBuffer of the stream:
  TTFT, gaps between chunks, stall time, effective tokens, finished requests;
- sampled every METRICS_INTERVAL_S (tokenflow/serve/routing/agent.py): buffer
  occupancy of running streams, stream counts, tokens sent (the stream
  tracker's total: one counter call a sample instead of one a chunk), and
  the TokenFlow scheduler's state (SchedulerState,
  tokenflow/core/sched_state.py). Totals (the scheduler's counters since the
  engine started, the tracker's tokens) are exported as the increase since
  the last sample (CumulativeDeltas).

Importing this module does not import Ray: the dashboard generator and the
README table use SPECS only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow.core.sched_state import SchedulerState

PREFIX = "ray_"  # added by Ray's metrics agent
# Sampling period of gauges, buffer occupancy and the token counter: well
# under any scrape interval, and each sample costs a metric call per stream.
METRICS_INTERVAL_S = 1.0

# Chat: a first token within 50 ms is instant, 30 s is a lost user.
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0)
BUFFER_BUCKETS = (0.05, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)

# vLLM's own labels (ray_vllm_*): TokenFlow's series join them without relabelling.
ENGINE_TAGS = ("model_name", "ReplicaId")
ROUTER_TAGS = ("application", "deployment")


@dataclass(frozen=True)
class Spec:
    name: str  # as given to Ray (before its prefix)
    kind: str  # counter | gauge | histogram
    help: str
    tags: tuple[str, ...] = ENGINE_TAGS
    buckets: tuple[float, ...] = ()

    def exported(self, part: str = "") -> str:
        """The name Prometheus sees. `part`: bucket, sum or count (histograms)."""
        base = PREFIX + self.name
        if self.kind == "counter":
            return base + "_total"
        if self.kind == "histogram" and part:
            return f"{base}_{part}"
        return base


SPECS = (
    # per request (streams only, except tokens and finished requests)
    Spec("tokenflow_ttft_seconds", "histogram",
         "Time to first token of a stream: request reached the replica -> first token sent.",
         buckets=LATENCY_BUCKETS),
    Spec("tokenflow_chunk_gap_seconds", "histogram",
         "Gap between consecutive token-bearing chunks a replica sends for one stream. Serve batches tokens "
         "into chunks (stream_batching_interval_ms), so this is not the time between tokens; vLLM's "
         "ray_vllm_inter_token_latency_seconds is.",
         buckets=LATENCY_BUCKETS),
    Spec("tokenflow_request_stall_seconds", "histogram",
         "Per finished stream: time its reader (ReaderBuffer model) waited on an empty buffer.",
         buckets=LATENCY_BUCKETS),
    Spec("tokenflow_stall_seconds", "counter",
         "Reader stall time of finished streams, summed (seconds)."),
    Spec("tokenflow_effective_tokens", "counter",
         "Weighted tokens of finished streams (ReaderBuffer.effective_tokens with the final length); "
         "rate() is effective throughput."),
    Spec("tokenflow_generated_tokens", "counter",
         "Tokens sent to clients (usage.completion_tokens when the stream carries it)."),
    Spec("tokenflow_requests_finished", "counter",
         "Requests that ended, by stream (true/false) and status (ok, error, cancelled, moved: handed to another "
         "engine by a rebalance).",
         tags=ENGINE_TAGS + ("stream", "status")),
    # sampled
    Spec("tokenflow_buffer_seconds", "histogram",
         f"Buffered seconds of each running stream, sampled every {METRICS_INTERVAL_S} s.",
         buckets=BUFFER_BUCKETS),
    Spec("tokenflow_streams", "gauge",
         "Open streams on the replica: running (got a token), waiting (none yet), stalled (empty buffer).",
         tags=ENGINE_TAGS + ("state",)),
    Spec("tokenflow_scheduler_requests", "gauge",
         "Requests in the TokenFlow scheduler: running, waiting, paused_hold, paused_release.",
         tags=ENGINE_TAGS + ("state",)),
    Spec("tokenflow_pauses", "counter", "Pauses by kind: hold (KV kept) or release (KV freed).",
         tags=ENGINE_TAGS + ("kind",)),
    Spec("tokenflow_pauses_skipped", "counter",
         "Pauses the policy decided that could not be applied (request finished, not running, or mid-prompt)."),
    Spec("tokenflow_resumes", "counter", "Paused requests put back to run."),
    Spec("tokenflow_fallbacks", "counter", "Policy decisions that fell back to FCFS."),
    Spec("tokenflow_tokens_recomputed", "counter",
         "KV tokens recomputed when released requests resumed (neither cached nor reloaded)."),
    Spec("tokenflow_kv_offload_blocks", "counter",
         "Host KV tier traffic in host blocks, by direction: stored (device->host) or loaded (host->device).",
         tags=ENGINE_TAGS + ("direction",)),
    Spec("tokenflow_kv_offload_bytes", "counter", "Host KV tier traffic in bytes, by direction.",
         tags=ENGINE_TAGS + ("direction",)),
    Spec("tokenflow_kv_offload_evictions", "counter", "Blocks evicted from the host KV tier."),
    Spec("tokenflow_kv_offload_reloads_skipped", "counter",
         "Resumes recomputed although the host tier held their KV (prefill beat the transfer)."),
    Spec("tokenflow_kv_pool_blocks", "gauge",
         "KV pools in blocks: tier device (engine blocks) or host (host rows), kind capacity or used.",
         tags=ENGINE_TAGS + ("tier", "kind")),
    # request router (ingress processes)
    Spec("tokenflow_router_decisions", "counter",
         "Routing decisions: slack (ranked by buffer slack) or fallback (Serve's power of two).",
         tags=ROUTER_TAGS + ("outcome",)),
    Spec("tokenflow_router_choose_seconds", "histogram", "Time inside choose_replicas (s).",
         tags=ROUTER_TAGS, buckets=(1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.002, 0.005, 0.01, 0.05)),
    Spec("tokenflow_router_state_age_seconds", "histogram", "Age of the chosen engine's state at decision (s).",
         tags=ROUTER_TAGS, buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)),
    # the ingress's failover and continuation (tokenflow/serve/failover.py, continuation.py)
    Spec("tokenflow_engine_losses", "counter",
         "Requests whose engine was lost under them, by outcome: resent (no token yet), continued (on another "
         "engine), finished (lost after its last token: the ingress closed the stream), ended_mid_stream (error "
         "event), gave_up (503 after the re-sends); and by cause: failure (the replica or its engine died), "
         "shutdown (Serve stopped the replica: a redeploy or a scale-down), rebalance (its busy engine moved the "
         "stream to one with slack).",
         tags=ROUTER_TAGS + ("outcome", "cause")),
    Spec("tokenflow_continuation_gap_seconds", "histogram",
         "Per continued stream: the time its reader got no token, from the last token before the loss to the "
         "continuation's first.", tags=ROUTER_TAGS, buckets=LATENCY_BUCKETS),
    Spec("tokenflow_continuation_stall_seconds", "counter",
         "Of those gaps, the time readers waited on an empty buffer (the gap less the buffer held), summed.",
         tags=ROUTER_TAGS),
    Spec("tokenflow_continuation_stalls", "counter",
         "Continued streams whose reader ran dry before the continuation's first token.", tags=ROUTER_TAGS),
)
BY_NAME = {s.name: s for s in SPECS}


def exported(name: str, part: str = "") -> str:
    return BY_NAME[name].exported(part)


def markdown_table() -> str:
    """The README's table (kept in sync by tests/test_observability.py)."""
    rows = ["| exported name | type | tags | what |", "| --- | --- | --- | --- |"]
    for s in SPECS:
        name = f"{PREFIX}{s.name}_{{bucket,sum,count}}" if s.kind == "histogram" else s.exported()
        rows.append(f"| `{name}` | {s.kind} | {', '.join(s.tags)} | {s.help} |")
    return "\n".join(rows)


class CumulativeDeltas:
    """Turns totals since some start (the scheduler's counters) into
    increases for Ray Counters. The first value counts in full (the engine
    and its replica start together); a total that goes down means its
    source restarted, and counts in full again."""

    def __init__(self) -> None:
        self.last: dict = {}

    def delta(self, key, total) -> float:
        if not isinstance(total, (int, float)) or not math.isfinite(total):
            return 0.0
        prev = self.last.get(key, 0)
        self.last[key] = total
        return float(total if total < prev else total - prev)


class MetricSet:
    """Ray metrics for SPECS with some tags fixed (e.g. model and engine)."""

    def __init__(self, specs, fixed: dict[str, str]):
        from ray.util import metrics as ray_metrics

        self.fixed = {k: str(v) for k, v in fixed.items()}
        self._m = {}
        for s in specs:
            if s.kind == "histogram":
                m = ray_metrics.Histogram(s.name, description=s.help, boundaries=list(s.buckets), tag_keys=s.tags)
            elif s.kind == "counter":
                m = ray_metrics.Counter(s.name, description=s.help, tag_keys=s.tags)
            else:
                m = ray_metrics.Gauge(s.name, description=s.help, tag_keys=s.tags)
            m.set_default_tags({k: v for k, v in self.fixed.items() if k in s.tags})
            self._m[s.name] = m

    def inc(self, name: str, value: float, **tags: str) -> None:
        if value > 0:
            self._m[name].inc(value, tags=tags or None)

    def set(self, name: str, value, **tags: str) -> None:
        if value is not None:
            self._m[name].set(float(value), tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._m[name].observe(float(value), tags=tags or None)

    def zero(self, name: str, **tags: str) -> None:
        """Create a counter's series at 0, so dashboards show 0 rather than
        nothing before its first event. Counter.inc() refuses 0, so this
        records through the underlying Ray recorder; best effort."""
        m = self._m[name]
        try:
            m._metric.record(0.0, tags={**m._default_tags, **tags})
        except Exception:
            pass


def engine_specs():
    return [s for s in SPECS if s.tags[:2] == ENGINE_TAGS]


class EngineMetrics:
    """One engine replica's metrics. The per-request hooks are called by
    tokenflow/serve/streams.py (EngineTracker's `sink`), the sampled ones by the
    replica's EngineAgent."""

    def __init__(self, model: str, engine: str):
        self.model, self.engine = model, engine
        self.m = MetricSet(engine_specs(), {"model_name": model, "ReplicaId": engine})
        self.deltas = CumulativeDeltas()
        for name, tags in (("tokenflow_pauses", {"kind": "hold"}), ("tokenflow_pauses", {"kind": "release"}),
                           ("tokenflow_pauses_skipped", {}), ("tokenflow_resumes", {}), ("tokenflow_fallbacks", {}),
                           ("tokenflow_tokens_recomputed", {}), ("tokenflow_stall_seconds", {}),
                           ("tokenflow_effective_tokens", {}), ("tokenflow_generated_tokens", {}),
                           ("tokenflow_kv_offload_evictions", {}), ("tokenflow_kv_offload_reloads_skipped", {}),
                           *((n, {"direction": d}) for n in ("tokenflow_kv_offload_blocks", "tokenflow_kv_offload_bytes")
                             for d in ("stored", "loaded"))):
            self.m.zero(name, **tags)

    # --- per request (EngineTracker sink) ---------------------------------
    def on_first_token(self, ttft: float) -> None:
        self.m.observe("tokenflow_ttft_seconds", max(0.0, ttft))

    def on_gap(self, seconds: float) -> None:
        self.m.observe("tokenflow_chunk_gap_seconds", max(0.0, seconds))

    def on_finish(self, reader, *, stream: bool, status: str, now: float) -> None:
        """`reader`: the stream's ReaderBuffer (None for a non-streaming request)."""
        if reader is not None and reader.delivered:
            reader.on_finish(now)
            stall = reader.stall_time(now)
            self.m.observe("tokenflow_request_stall_seconds", stall)
            self.m.inc("tokenflow_stall_seconds", stall)
            self.m.inc("tokenflow_effective_tokens", reader.effective_tokens(reader.delivered))
        self.m.inc("tokenflow_requests_finished", 1, stream=str(stream).lower(), status=status)

    # --- sampled (EngineAgent) --------------------------------------------
    def sample_streams(self, buffers_s: list[float], state: dict, tokens_total: int = 0) -> None:
        """`tokens_total`: tokens the replica has sent since it started."""
        self.m.inc("tokenflow_generated_tokens", self.deltas.delta("generated_tokens", tokens_total))
        for b in buffers_s:
            self.m.observe("tokenflow_buffer_seconds", max(0.0, b))
        for key in ("running", "waiting", "stalled"):
            self.m.set("tokenflow_streams", state.get(key, 0), state=key)

    def sample_scheduler(self, sched: SchedulerState | None) -> None:
        """Export the scheduler's state (None: not TokenFlow's scheduler)."""
        if sched is None:
            return
        for key in ("running", "waiting", "paused_hold", "paused_release"):
            self.m.set("tokenflow_scheduler_requests", getattr(sched, key), state=key)
        stats, d = sched.stats, self.deltas.delta
        self.m.inc("tokenflow_pauses", d("pauses_hold", stats.pauses_hold), kind="hold")
        self.m.inc("tokenflow_pauses", d("pauses_release", stats.pauses_release), kind="release")
        for key, name in (("pauses_skipped", "tokenflow_pauses_skipped"),
                          ("resumes", "tokenflow_resumes"), ("fallbacks", "tokenflow_fallbacks"),
                          ("tokens_recomputed", "tokenflow_tokens_recomputed")):
            self.m.inc(name, d(key, getattr(stats, key)))
        total, free = sched.kv_total_blocks, sched.kv_free_blocks
        self.m.set("tokenflow_kv_pool_blocks", total, tier="device", kind="capacity")
        self.m.set("tokenflow_kv_pool_blocks", total - free, tier="device", kind="used")
        off = sched.offload
        if off is None:
            return
        for direction in ("stored", "loaded"):
            self.m.inc("tokenflow_kv_offload_blocks", d(f"blocks_{direction}", getattr(off, f"blocks_{direction}")),
                       direction=direction)
            self.m.inc("tokenflow_kv_offload_bytes", d(f"bytes_{direction}", getattr(off, f"bytes_{direction}")),
                       direction=direction)
        self.m.inc("tokenflow_kv_offload_evictions", d("evictions", off.evictions))
        self.m.inc("tokenflow_kv_offload_reloads_skipped", d("reloads_skipped", off.reloads_skipped))
        self.m.set("tokenflow_kv_pool_blocks", off.capacity_blocks, tier="host", kind="capacity")
        # Every stored row stays until evicted (only ready rows are evicted).
        used = off.blocks_stored - off.evictions
        self.m.set("tokenflow_kv_pool_blocks", max(0, used), tier="host", kind="used")


class RouterMetrics:
    """The request router's metrics (one per router instance in an ingress)."""

    def __init__(self, application: str, deployment: str):
        specs = [s for s in SPECS if s.name.startswith("tokenflow_router_")]
        self.m = MetricSet(specs, {"application": application, "deployment": deployment})
        for outcome in ("slack", "fallback"):
            self.m.zero("tokenflow_router_decisions", outcome=outcome)

    def on_decision(self, seconds: float, chosen: str | None, state_age_s: float | None) -> None:
        self.m.inc("tokenflow_router_decisions", 1, outcome="fallback" if chosen is None else "slack")
        self.m.observe("tokenflow_router_choose_seconds", seconds)
        if state_age_s is not None:
            self.m.observe("tokenflow_router_state_age_seconds", state_age_s)


class IngressMetrics:
    """What the ingress's failover saw: engine losses and continuations."""

    NAMES = ("tokenflow_engine_losses", "tokenflow_continuation_gap_seconds",
             "tokenflow_continuation_stall_seconds", "tokenflow_continuation_stalls")

    def __init__(self, application: str, deployment: str, outcomes: tuple[str, ...], causes: tuple[str, ...]):
        specs = [s for s in SPECS if s.name in self.NAMES]
        self.m = MetricSet(specs, {"application": application, "deployment": deployment})
        for outcome in outcomes:  # series from the start: a window without losses reads 0
            for cause in causes:
                self.m.zero("tokenflow_engine_losses", outcome=outcome, cause=cause)
        self.m.zero("tokenflow_continuation_stall_seconds")
        self.m.zero("tokenflow_continuation_stalls")

    def on_lost(self, outcome: str, cause: str) -> None:
        self.m.inc("tokenflow_engine_losses", 1, outcome=outcome, cause=cause)

    def on_splice(self, gap_s: float, stall_s: float) -> None:
        self.m.observe("tokenflow_continuation_gap_seconds", gap_s)
        if stall_s > 0:
            self.m.inc("tokenflow_continuation_stall_seconds", stall_s)
            self.m.inc("tokenflow_continuation_stalls", 1)
