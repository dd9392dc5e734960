"""`tokenflow loadtest`: run the locustfile headless and summarise the run.

Locust is run as its own process (`python -m locust -f tokenflow/tools/loadtest/locustfile.py
--headless ...`): importing Locust monkeypatches the whole process with
gevent, which must not happen to the CLI or a pytest process, and Locust's
own CLI writes the CSV and HTML reports. The child prints a progress line a
second; it stops by itself (all requests reported, or the time limit), and
this process kills it if it outlives the limit by SHUTDOWN_GRACE_S.

OUT gets: locust_stats.csv, locust_stats_history.csv, locust_failures.csv,
locust_exceptions.csv (Locust's --csv), report.html (--html),
requests.jsonl (one line per request) and summary.json.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from tokenflow.tools.launcher import stop as stop_group
from tokenflow.tools.loadtest.exporter import add_arguments as add_metrics_arguments
from tokenflow.tools.loadtest.shapes import add_workload_arguments, schedule_from_args, time_limit

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
ROOT = LOCUSTFILE.parents[3]
SHUTDOWN_GRACE_S = 60.0  # Locust's own shutdown: stop users, write CSV and HTML
OUTPUTS = ("requests.jsonl", "summary.json", "report.html", "locust_stats.csv", "locust_stats_history.csv",
           "locust_failures.csv", "locust_exceptions.csv")


def check_host(host: str, allow_remote: bool = False) -> str:
    """An http(s) URL; a loopback host unless allow_remote."""
    parts = urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--host must be an http(s) URL such as http://127.0.0.1:8000, got {host!r}")
    if not allow_remote:
        name = parts.hostname
        try:
            loopback = ipaddress.ip_address(name).is_loopback
        except ValueError:
            loopback = name == "localhost"
        if not loopback:
            raise ValueError(f"--host {host} is not a loopback address; pass --allow-remote to load-test it")
    return host


def add_arguments(parser) -> None:
    parser.add_argument("--host", default="http://127.0.0.1:8000", help="base URL of the OpenAI API server")
    add_workload_arguments(parser)
    parser.add_argument("--out", default="out/loadtest", help="directory for the reports")
    add_metrics_arguments(parser)


def locust_command(args, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "--loglevel", "WARNING", "--host", args.host,
           "--csv", str(out / "locust"), "--html", str(out / "report.html"),
           "--jsonl", str(out / "requests.jsonl"),
           "--model", args.model, "--shape", args.shape, "--requests", str(args.requests),
           "--rates", args.rates, "--cv", repr(args.cv), "--bursts", str(args.bursts),
           "--max-tokens", str(args.max_tokens), f"--prompt={args.prompt}", "--seed", str(args.seed),
           "--request-timeout", repr(args.request_timeout)]
    for flag, value in (("--arrival-rate", args.arrival_rate), ("--period", args.period),
                        ("--time-limit", args.time_limit)):
        if value is not None:
            cmd += [flag, repr(value)]
    if args.allow_remote:
        cmd.append("--allow-remote")
    if args.metrics_port is not None:
        cmd += ["--metrics-port", str(args.metrics_port), "--run", args.run]
    return cmd


def _default_sigint() -> None:
    # A child of a non-interactive shell inherits SIGINT ignored; Locust
    # needs it live, as SIGINT is its graceful stop (reports still written).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(args) -> int:
    """Validate, run Locust, write summary.json; Locust's exit code (1: some failed)."""
    check_host(args.host, args.allow_remote)
    schedule = schedule_from_args(args)
    limit = time_limit(args, schedule)
    out = Path(args.out).resolve()  # absolute: the child may resolve paths elsewhere
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:  # never leave a previous run's files looking fresh
        (out / name).unlink(missing_ok=True)

    print(f"loadtest: {args.requests} requests ({args.shape}), rates {args.rates} tokens/s, "
          f"max_tokens {args.max_tokens}, to {args.host}; stops by itself within {limit:.0f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # Own session, so the child is stopped as a group and only by us: a
    # Ctrl-C here is forwarded once, after which it still writes its reports.
    proc = subprocess.Popen(locust_command(args, out), env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_default_sigint)
    try:
        rc = proc.wait(timeout=limit + SHUTDOWN_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"loadtest: Locust did not stop within {limit + SHUTDOWN_GRACE_S:.0f} s; stopping it", file=sys.stderr)
        stop_group(proc, 30.0)  # SIGINT: Locust writes its reports (it ignores SIGTERM in a shape run)
        rc = 124
    except KeyboardInterrupt:
        stop_group(proc, 30.0)  # SIGINT: Locust writes its reports (it ignores SIGTERM in a shape run)
        rc = 130

    records = read_jsonl(out / "requests.jsonl")
    summary = summarize(records, args.requests)
    summary["locust_exit_code"] = proc.returncode
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"wrote {out}/summary.json, requests.jsonl, report.html, locust_*.csv")
    if rc == 0 and summary["failed"]:
        rc = 1  # e.g. a line missing from requests.jsonl
    return rc


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summarize(records: list[dict], requests: int) -> dict:
    """Run-level figures from the per-request lines (same definitions as `tokenflow bench`)."""
    from tokenflow.tools.bench import percentile

    ok = [r for r in records if r["ok"]]
    sent = [r for r in records if r.get("sent_s") is not None and r.get("total_s") is not None]
    wall = max((r["sent_s"] + r["total_s"] for r in sent), default=0.0) - min((r["sent_s"] for r in sent), default=0.0)
    ttfts = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    tbts = [x for r in ok for x in r["tbt_s"]]
    tokens = sum(r.get("tokens") or 0 for r in records)
    effective = sum(r.get("effective_tokens") or 0.0 for r in records)

    def mean(xs):
        return statistics.fmean(xs) if xs else None

    def pct(xs, q):
        return percentile(xs, q) if xs else None

    return {
        "requests": requests,
        "completed": len(ok),
        "failed": requests - len(ok),  # includes requests with no line at all
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "tbt_p99_s": pct(tbts, 0.99),  # between chunks
        "stall_s_mean": mean([r["stall_s"] for r in ok]),
        "qoe_mean": mean([r["qoe"] for r in ok]),
        "tokens": tokens,
        "throughput_tps": tokens / wall if wall > 0 else None,
        "effective_throughput_tps": effective / wall if wall > 0 else None,
        "wall_s": wall,
    }
