"""TokenFlow's Grafana dashboards as code.

    python dashboards/generate.py           # rewrite dashboards/*.json
    python dashboards/generate.py --check   # exit 1 if a checked-in file is stale
    tokenflow dashboards generate / push    # the same, and upload to a Grafana

Every query names metrics through tokenflow/serve/metrics.py (`exported()`), so a
renamed metric cannot leave a dashboard behind. Variables: `datasource` (any
Prometheus), `model`, and on the drill-down `engine`.
tests/test_observability.py runs every panel's query against a real
Prometheus scraping the running app and fails on an empty answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tokenflow.serve.metrics import exported as X  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
# The labels of vLLM's own series (ray_vllm_*), so the two join as they are.
M = 'model_name=~"$model"'
ME = 'model_name=~"$model", ReplicaId=~"$engine"'
RI = "[$__rate_interval]"


def rate(metric: str, sel: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}{RI}))"


def quantile(q: float, name: str, sel: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(X(name, 'bucket'), sel, ', '.join(filter(None, ['le', by])))})"


def target(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": DS}


def panel(title: str, targets: list[dict], unit: str = "short", description: str = "") -> dict:
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": targets}


def variables(engine: bool) -> list[dict]:
    def query_var(name: str, query: str, label: str) -> dict:
        return {"type": "query", "name": name, "label": label, "datasource": DS,
                "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
                "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"selected": True, "text": "All", "value": "$__all"}, "sort": 1}

    out = [{"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
            "current": {}, "hide": 0},
           query_var("model", f"label_values({X('tokenflow_generated_tokens')}, model_name)", "Model")]
    if engine:
        out.append(query_var(
            "engine", f'label_values({X("tokenflow_generated_tokens")}{{model_name=~"$model"}}, ReplicaId)', "Engine"))
    return out


def dashboard(uid: str, title: str, panels: list[dict], engine_var: bool = False) -> dict:
    placed = []
    for i, p in enumerate(panels):
        p = dict(p, id=i + 1, gridPos={"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)})
        p["targets"] = [dict(t, refId=chr(ord("A") + j)) for j, t in enumerate(p["targets"])]
        placed.append(p)
    return {"uid": uid, "title": title, "tags": ["tokenflow"], "timezone": "browser", "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
            "templating": {"list": variables(engine_var)}, "annotations": {"list": []}, "panels": placed}


def latency_panels(sel: str, by: str = "", legend: str = "") -> list[dict]:
    sfx = f" {legend}" if legend else ""
    return [
        panel("Time to first token (P50, P99)", [
            target(quantile(0.5, "tokenflow_ttft_seconds", sel, by), "P50" + sfx),
            target(quantile(0.99, "tokenflow_ttft_seconds", sel, by), "P99" + sfx)], "s",
            "Request reached the replica -> first token sent, streams only."),
        panel("Gap between chunks sent (P50, P99)", [
            target(quantile(0.5, "tokenflow_chunk_gap_seconds", sel, by), "P50" + sfx),
            target(quantile(0.99, "tokenflow_chunk_gap_seconds", sel, by), "P99" + sfx)], "s",
            "Gap between token-bearing chunks the replica sends (Serve batches tokens into chunks)."),
        panel("Effective vs raw throughput", [
            target(rate(X("tokenflow_effective_tokens"), sel, by), "effective" + sfx),
            target(rate(X("tokenflow_generated_tokens"), sel, by), "raw" + sfx)], "tokens/s",
            "Effective: tokens weighted by the reader's buffer at arrival (counted when a stream ends)."),
        panel("Reader stalls", [
            target(rate(X("tokenflow_stall_seconds"), sel, by), "stall seconds per second" + sfx),
            target(quantile(0.9, "tokenflow_request_stall_seconds", sel, by), "P90 stall per request" + sfx)], "s"),
    ]


def overview() -> dict:
    return dashboard("tokenflow-overview", "TokenFlow / Overview", latency_panels(M) + [
        panel("Queue", [
            target(f'sum by (state) ({X("tokenflow_scheduler_requests")}'
                   f'{{{M}, state=~"waiting|paused_hold|paused_release"}})', "{{state}}"),
            target(f'sum({X("tokenflow_streams")}{{{M}, state="waiting"}})', "streams without a first token")],
            description="Scheduler queue (waiting, paused) and replica streams still waiting for a token."),
        panel("Finished requests", [target(rate(X("tokenflow_requests_finished"), M, "status"), "{{status}}")],
              "reqps"),
        panel("Engine TTFT as vLLM measures it (P50)", [
            target('histogram_quantile(0.5, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket'
                   f'{{model_name=~"$model"}}{RI})))', "vLLM P50")], "s",
            "vLLM's own metric (ray_vllm_*), next to the replica-side TTFT above."),
        panel("Routing decisions", [
            target(f'sum by (outcome) (rate({X("tokenflow_router_decisions")}{RI}))', "{{outcome}}")], "ops",
            "Request router in the ingress: engines ranked by buffer slack, or Serve's fallback."),
        panel("Routing latency (P99)", [
            target(f'histogram_quantile(0.99, sum by (le) (rate({X("tokenflow_router_choose_seconds", "bucket")}{RI})))',
                   "choose_replicas"),
            target(f'histogram_quantile(0.99, sum by (le) (rate({X("tokenflow_router_state_age_seconds", "bucket")}{RI})))',
                   "age of the chosen engine's state")], "s"),
        panel("Engine losses", [
            target(f'sum by (outcome, cause) (rate({X("tokenflow_engine_losses")}{RI}))', "{{outcome}} ({{cause}})")],
            "reqps",
            "Requests whose engine replica or EngineCore was lost under them (failure), or whose replica Serve "
            "stopped (shutdown: a redeploy or a scale-down): re-sent before the first token, continued on another "
            "engine after it (tokenflow/serve/continuation.py), or ended with an error event."),
        panel("Continuation gap", [
            # `> 0` and `or vector(0)`: a window without a splice reads 0, not NaN.
            target(f'(sum(rate({X("tokenflow_continuation_gap_seconds", "sum")}{RI})) / '
                   f'(sum(rate({X("tokenflow_continuation_gap_seconds", "count")}{RI})) > 0)) or vector(0)', "mean"),
            target(f'(histogram_quantile(0.99, sum by (le) (rate({X("tokenflow_continuation_gap_seconds", "bucket")}'
                   f'{RI}))) and on() (sum(rate({X("tokenflow_continuation_gap_seconds", "count")}{RI})) > 0)) '
                   f'or vector(0)', "P99")], "s",
            "Per continued stream, the time its reader got no token: from the last token before its engine was "
            "lost to the continuation's first."),
        panel("Continuations: readers left waiting", [
            target(f'sum(rate({X("tokenflow_continuation_stall_seconds")}{RI}))', "seconds waited, per s"),
            target(f'sum(rate({X("tokenflow_continuation_stalls")}{RI}))', "readers that ran dry, per s")],
            "short", "Continued streams whose reader emptied its buffer before the continuation's first token."),
    ] + client_panels())


def client_panels() -> list[dict]:
    """What the readers saw: the load-test client's own exporter
    (tokenflow/tools/loadtest/exporter.py; job tokenflow-client), by run
    (the policy under test in bench-app). Empty unless a client exports."""
    def q(p: float, name: str) -> str:
        return f'histogram_quantile({p}, sum by (le, run) (rate({name}_bucket{{{M}}}{RI})))'

    return [
        panel("Client: TTFT the readers saw (P50, P99)", [
            target(q(0.5, "tokenflow_client_ttft_seconds"), "P50 {{run}}"),
            target(q(0.99, "tokenflow_client_ttft_seconds"), "P99 {{run}}")], "s",
            "Send -> first token at the client, beside the replica-side TTFT above."),
        panel("Client: stalls and effective throughput", [
            target(f"sum by (run) (rate(tokenflow_client_stall_seconds_sum{{{M}}}{RI}))", "stall s/s {{run}}"),
            target(f"sum by (run) (rate(tokenflow_client_effective_tokens_total{{{M}}}{RI}))",
                   "effective tokens/s {{run}}"),
            target(f"sum by (run) (rate(tokenflow_client_tokens_total{{{M}}}{RI}))", "tokens/s {{run}}")],
            description="Seconds of stall per second across readers, and tokens that came when needed vs all."),
        panel("Client: requests ended", [
            target(f"sum by (run, outcome) (rate(tokenflow_client_requests_total{{{M}}}{RI}))", "{{run}} {{outcome}}")],
            "reqps"),
    ]


def scheduler() -> dict:
    return dashboard("tokenflow-scheduler", "TokenFlow / Scheduler", [
        panel("Scheduler requests", [
            target(f'sum by (state) ({X("tokenflow_scheduler_requests")}{{{M}}})', "{{state}}")]),
        panel("Pauses and resumes", [
            target(rate(X("tokenflow_pauses"), M, "kind"), "pause ({{kind}})"),
            target(rate(X("tokenflow_resumes"), M), "resume"),
            target(rate(X("tokenflow_pauses_skipped"), M), "pause skipped"),
            target(rate(X("tokenflow_fallbacks"), M), "FCFS fallback")], "ops"),
        panel("Buffer occupancy of running streams (P10, P50, P90)", [
            target(quantile(q, "tokenflow_buffer_seconds", M), f"P{round(q * 100)}") for q in (0.1, 0.5, 0.9)],
            "s", "Buffered seconds of each running stream, sampled every 0.5 s."),
        panel("Replica streams", [target(f'sum by (state) ({X("tokenflow_streams")}{{{M}}})', "{{state}}")]),
    ])


def kv() -> dict:
    pool = X("tokenflow_kv_pool_blocks")
    return dashboard("tokenflow-kv", "TokenFlow / KV", [
        panel("Offload traffic", [target(rate(X("tokenflow_kv_offload_bytes"), M, "direction"), "{{direction}}")],
              "Bps", "Host KV tier: stored = device -> host, loaded = host -> device."),
        panel("Offload blocks and evictions", [
            target(rate(X("tokenflow_kv_offload_blocks"), M, "direction"), "{{direction}}"),
            target(rate(X("tokenflow_kv_offload_evictions"), M), "evicted")], "ops"),
        panel("Pool usage", [
            target(f'sum by (tier) ({pool}{{{M}, kind="used"}}) / sum by (tier) ({pool}{{{M}, kind="capacity"}})',
                   "{{tier}}")], "percentunit", "Used / capacity of the device KV pool and the host tier."),
        panel("Reload vs recompute", [
            target(rate(X("tokenflow_kv_offload_blocks"), f'{M}, direction="loaded"'), "host blocks reloaded/s"),
            target(rate(X("tokenflow_tokens_recomputed"), M), "tokens recomputed/s"),
            target(rate(X("tokenflow_kv_offload_reloads_skipped"), M), "resumes recomputed by choice/s")], "short",
            "After a release pause: KV reloaded from the host tier vs recomputed (by choice: prefill beat the "
            "transfer)."),
    ])


def engine() -> dict:
    by = "ReplicaId"
    return dashboard("tokenflow-engine", "TokenFlow / Engine drill-down", latency_panels(ME, by, "{{ReplicaId}}") + [
        panel("Scheduler requests", [
            target(f'sum by (ReplicaId, state) ({X("tokenflow_scheduler_requests")}{{{ME}}})', "{{ReplicaId}} {{state}}")]),
        panel("Pauses and resumes", [
            target(rate(X("tokenflow_pauses"), ME, "ReplicaId, kind"), "{{ReplicaId}} pause ({{kind}})"),
            target(rate(X("tokenflow_resumes"), ME, by), "{{ReplicaId}} resume")], "ops"),
        panel("Buffer occupancy (P50)", [target(quantile(0.5, "tokenflow_buffer_seconds", ME, by), "{{ReplicaId}}")],
              "s"),
        panel("KV offload traffic", [
            target(rate(X("tokenflow_kv_offload_bytes"), ME, "ReplicaId, direction"), "{{ReplicaId}} {{direction}}")],
            "Bps"),
        panel("KV pool blocks", [
            target(f'sum by (ReplicaId, tier, kind) ({X("tokenflow_kv_pool_blocks")}{{{ME}}})',
                   "{{ReplicaId}} {{tier}} {{kind}}")]),
        panel("Finished requests", [
            target(rate(X("tokenflow_requests_finished"), ME, "ReplicaId, status"), "{{ReplicaId}} {{status}}")], "reqps"),
        panel("vLLM KV cache usage", [
            target('max by (ReplicaId) (ray_vllm_kv_cache_usage_perc{model_name=~"$model", ReplicaId=~"$engine"})',
                   "{{ReplicaId}}")], "percentunit",
            "vLLM's own gauge, on the same ReplicaId label as TokenFlow's."),
    ], engine_var=True)


DASHBOARDS = {"tokenflow-overview": overview, "tokenflow-scheduler": scheduler, "tokenflow-kv": kv,
              "tokenflow-engine": engine}


def render() -> dict[str, str]:
    """File name -> JSON text, deterministic."""
    return {f"{name}.json": json.dumps(make(), indent=2, sort_keys=True) + "\n" for name, make in DASHBOARDS.items()}


def write(out_dir: Path = OUT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render().items():
        path = out_dir / name
        path.write_text(text)
        paths.append(path)
    return paths


def stale(out_dir: Path = OUT_DIR) -> list[str]:
    return [name for name, text in render().items()
            if not (out_dir / name).is_file() or (out_dir / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = p.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        if bad:
            print(f"stale dashboards (run python dashboards/generate.py): {', '.join(bad)}", file=sys.stderr)
        return 1 if bad else 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
