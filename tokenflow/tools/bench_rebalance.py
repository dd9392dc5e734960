"""`tokenflow bench-rebalance`: a skewed burst with and without moving streams.

The slack router cannot know answer lengths, so long answers can pile onto
one engine. This bench makes that skew on purpose: every stream of a burst
goes to one engine (`tokenflow_engine`; the app is started with engine
pinning allowed and `router.rebalance` on), slow readers whose buffers
build up while the engine time-shares, who together need `--load` x that
engine's share of the app's measured capacity. The same burst runs in
rounds, in turns, on the same app:

- off: every stream asks to stay (`tokenflow_rebalance: false`): the skew
  as the router left it, at the same per-token cost (still continuable);
- on: the same streams, movable: the busy engine hands paused streams to
  the idle one (tokenflow/serve/routing/rebalance.py).

Per round: the readers' stall time, TTFT, raw and effective throughput (the
client's token times) and the streams moved (the ingress's count of
continuations caused by a rebalance). OUT gets summary.json,
requests-<setting>-<n>.jsonl, app.yaml and serve.log.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path

import yaml

from tokenflow.core.config import PIN_KEY, REBALANCE_KEY
from tokenflow.tools import launcher
from tokenflow.tools.bench import percentile
from tokenflow.tools.bench_app import ServedApp, app_config, bench_paths, calibrate, engines_view, slots, summarize
from tokenflow.tools.loadtest import http_reader
from tokenflow.tools.loadtest.shapes import draw_rates, mean_rate, parse_rates

SETTINGS = ("off", "on")  # whether the streams may move


def wait_idle(base_url: str, timeout: float = 120.0) -> None:
    """Until no engine has a request (the last round's streams are gone)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        engines = engines_view(base_url)["engines"]
        if engines and all(e["running"] + e["waiting"] + e["unary"] == 0 for e in engines):
            return
        time.sleep(0.5)
    raise RuntimeError("the engines did not go idle between rounds")


def skewed_bodies(model: str, target: str, rates: list[float], max_tokens: int, prompt: str,
                  movable: bool) -> list[dict]:
    bodies = []
    for i, rate in enumerate(rates):
        body = http_reader.chat_body(model, f"{prompt} (reader {i})", max_tokens, rate)
        body[PIN_KEY] = target
        body[REBALANCE_KEY] = movable
        bodies.append(body)
    return bodies


def run_round(app: ServedApp, label: str, bodies: list[dict], rates: list[float], max_tokens: int,
              timeout: float) -> tuple[dict, list[dict]]:
    before = engines_view(app.base_url)["replicas_lost_by_cause"].get("rebalance", 0)
    records = asyncio.run(http_reader.run_schedule(app.base_url, bodies, rates, [0.0] * len(bodies), timeout,
                                                   None, launcher.api_key_from_env()))
    view = engines_view(app.base_url)
    res = summarize(records, max_tokens, slo_ttft=2.0, slo_stall=1.0)
    ok = [r for r in records if r["ok"]]
    res.update(rebalance=label, moved=view["replicas_lost_by_cause"].get("rebalance", 0) - before,
               stall_s_total=sum(r["stall_s"] for r in ok),
               stall_s_p99=percentile([r["stall_s"] for r in ok], 0.99) if ok else None,
               stalled_readers=sum(r["stall_s"] > 0.5 for r in ok))
    return res, records


def run_bench_rebalance(out_dir: str, config: str, *, load: float, rates: str, max_tokens: int, prompt: str,
                        rounds: int, seed: int, timeout: float, ready_timeout: float) -> dict:
    out, config_path, port = bench_paths(out_dir, config, None)
    doc = app_config(config_path, "tokenflow", port, 512, None, {})
    args = doc["applications"][0]["args"]
    if (args.get("num_replicas") or 1) < 2:
        raise RuntimeError("the config must run at least two engines")
    args["admission"]["engine_pinning"] = True
    args["router"] = {**(args.get("router") or {}), "rebalance": True}
    path = out / "app.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    results: dict[str, list[dict]] = {r: [] for r in SETTINGS}
    with ServedApp(path, out / "serve.log", ready_timeout, niceness=10) as app:
        engines = sorted(e["engine_id"] for e in engines_view(app.base_url)["engines"])
        cal = calibrate({"calibrating": app.first_url}, app.model, slots(doc), 512, prompt, timeout)
        mix = parse_rates(rates)
        n = max(1, math.ceil(load * cal["decode_tps"] / len(engines) / mean_rate(mix)))
        drawn = draw_rates(mix, n, seed)
        print(json.dumps({"calibration": cal, "engines": len(engines), "streams": n}), flush=True)
        for i in range(rounds):
            for setting in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]):
                wait_idle(app.base_url)
                bodies = skewed_bodies(app.model, engines[0], drawn, max_tokens, prompt, setting == "on")
                res, records = run_round(app, setting, bodies, drawn, max_tokens, timeout)
                results[setting].append(res)
                with open(out / f"requests-{setting}-{i}.jsonl", "w") as f:
                    for rec in records:
                        f.write(json.dumps(rec) + "\n")
                print(json.dumps({k: res[k] for k in ("rebalance", "completed", "failed", "moved", "stall_s_total",
                                                      "stall_s_p99", "stalled_readers", "ttft_p99_s",
                                                      "throughput_tps", "effective_throughput_tps")}), flush=True)
    summary = {"workload": {"config": config, "load": load, "rates": rates, "max_tokens": max_tokens,
                            "streams": n, "rounds": rounds, "seed": seed, "calibration": cal,
                            "skew": "every stream pinned to one engine (tokenflow_engine); the others idle",
                            "off": "streams sent with tokenflow_rebalance: false"},
               "results": results, "median": {r: _medians(results[r]) for r in SETTINGS}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _medians(runs: list[dict]) -> dict:
    keys = ("moved", "stall_s_total", "stall_s_p99", "stalled_readers", "ttft_p50_s", "ttft_p99_s",
            "throughput_tps", "effective_throughput_tps", "failed")
    return {k: percentile([r[k] for r in runs if r.get(k) is not None], 0.5) for k in keys
            if any(r.get(k) is not None for r in runs)}


def add_arguments(parser) -> None:
    from tokenflow.tools.loadtest.shapes import _positive_float, _positive_int, _rate_mix

    parser.add_argument("--config", default="configs/local.yaml", help="the `serve run` config (two engines or more)")
    parser.add_argument("--load", type=_positive_float, default=2.0,
                        help="the readers on the one engine need LOAD x its share of the app's measured capacity")
    parser.add_argument("--rates", type=_rate_mix, default="5:1,10:1,20:1",
                        help="reading rates, value:weight,...: slower than one stream's decode rate, so that "
                             "buffers build and the engine pauses readers")
    parser.add_argument("--max-tokens", type=_positive_int, default=400)
    parser.add_argument("--prompt", default="Tell me a long story about a lighthouse keeper.")
    parser.add_argument("--rounds", type=_positive_int, default=2, help="rounds per setting (off, on), in turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=_positive_float, default=600.0)
    parser.add_argument("--ready-timeout", type=_positive_float, default=600.0)
    parser.add_argument("--out", default="out/bench-rebalance")


def run(args) -> int:
    launcher.stop_on_signals()
    try:
        summary = run_bench_rebalance(args.out, args.config, load=args.load, rates=args.rates,
                                      max_tokens=args.max_tokens, prompt=args.prompt, rounds=args.rounds,
                                      seed=args.seed, timeout=args.request_timeout,
                                      ready_timeout=args.ready_timeout)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"tokenflow bench-rebalance: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary["median"]))
    print(f"wrote {Path(args.out)}/summary.json")
    return 1 if any(r["failed"] for runs in summary["results"].values() for r in runs) else 0
