"""What the readers saw, for Prometheus: the client's side of the dashboards.

`tokenflow bench-app --metrics-port P` and `tokenflow loadtest
--metrics-port P` serve these at http://HOST:P/metrics while they run; a
Prometheus that scrapes that port (job `tokenflow-client` in
configs/prometheus.yml) puts the readers' view in the overview dashboard's
client row, beside the servers'. Each finished request is counted once, from
the same record the JSONL gets (recorder.py: the shared reader model).

Labels: `model_name` (as on the server's series) and `run` (the policy
under test in bench-app; `--run` in loadtest).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# Name, kind, help: the dashboards and the README list them from here.
CLIENT_METRICS = (
    ("tokenflow_client_ttft_seconds", "histogram", "Time to first token as the reader saw it (send -> first token)."),
    ("tokenflow_client_stall_seconds", "histogram", "Per finished request: time its reader waited on an empty "
                                                    "buffer."),
    ("tokenflow_client_tokens_total", "counter", "Tokens the readers received."),
    ("tokenflow_client_effective_tokens_total", "counter", "Of those, tokens that arrived when the reader needed "
                                                           "them (effective throughput's weights)."),
    ("tokenflow_client_requests_total", "counter", "Requests ended, by outcome: ok or failed."),
)
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
LABELS = ("model_name", "run")


class ClientMetrics:
    """One registry per client process (no global state to collide with)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tokenflow_client_ttft_seconds", CLIENT_METRICS[0][2], LABELS, registry=r,
                              buckets=LATENCY_BUCKETS)
        self.stall = Histogram("tokenflow_client_stall_seconds", CLIENT_METRICS[1][2], LABELS, registry=r,
                               buckets=LATENCY_BUCKETS)
        # prometheus_client adds `_total` to counters itself.
        self.tokens = Counter("tokenflow_client_tokens", CLIENT_METRICS[2][2], LABELS, registry=r)
        self.effective = Counter("tokenflow_client_effective_tokens", CLIENT_METRICS[3][2], LABELS, registry=r)
        self.requests = Counter("tokenflow_client_requests", CLIENT_METRICS[4][2], LABELS + ("outcome",),
                                registry=r)
        self.server = None
        if port is not None:
            self.server, _ = start_http_server(port, addr=host, registry=r)

    def observe(self, record: dict, model: str, run: str) -> None:
        """One finished request, as recorder.RequestRecorder.result() gives it."""
        labels = {"model_name": model, "run": run}
        self.requests.labels(**labels, outcome="ok" if record.get("ok") else "failed").inc()
        if record.get("ttft_s") is not None:
            self.ttft.labels(**labels).observe(record["ttft_s"])
        if record.get("ok") and record.get("stall_s") is not None:
            self.stall.labels(**labels).observe(record["stall_s"])
        self.tokens.labels(**labels).inc(record.get("tokens") or 0)
        self.effective.labels(**labels).inc(record.get("effective_tokens") or 0.0)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def add_arguments(parser, run_label: bool = True) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve what the readers saw (TTFT, stalls, effective tokens) for Prometheus at "
                             "http://127.0.0.1:PORT/metrics while the run lasts")
    if run_label:
        parser.add_argument("--run", default="loadtest", help="the `run` label of those metrics")
