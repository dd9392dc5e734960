"""Locust users that stream chat completions and read them at a stated rate.

    locust -f tokenflow/tools/loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --shape burst --requests 20 --rates 10:0.5,20:0.3,40:0.2 --max-tokens 128

(`tokenflow loadtest` runs exactly this, plus reports.) The workload options
are in tokenflow/tools/loadtest/shapes.py. Every request is reported to Locust three times:

    CHAT   <path> r=<rate>   response time = whole answer, size = bytes; failures here
    TTFT   <path> r=<rate>   response time = time to first token
    STALL  <path> r=<rate>   response time = the reader's stall time (completed answers)

so Locust's tables and charts show TTFT and stall percentiles per reading
rate (Locust's request counts and RPS therefore include these entries).
Each request also becomes one JSON line in --jsonl (default: the
TOKENFLOW_LOADTEST_JSONL environment variable, else requests.jsonl).

Arrivals: ArrivalShape spawns users a little ahead of the schedule; each
user takes the next arrival, sleeps until its time, sends one request and
then idles until the run ends, so the request count is exact and arrival
times do not depend on Locust's task loop or one-second shape tick. The
run stops by itself when every request is reported or at --time-limit.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import sys
import time
from pathlib import Path

# Locust loads this file by path; make the repository importable for
# `loadtest.*` (an editable install made before tokenflow/tools/loadtest/ existed lacks it).
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import gevent  # noqa: E402
import requests  # noqa: E402
from locust import LoadTestShape, User, constant, events, task  # noqa: E402

from tokenflow.tools.loadtest.exporter import ClientMetrics  # noqa: E402
from tokenflow.tools.loadtest.exporter import add_arguments as add_metrics_arguments  # noqa: E402
from tokenflow.tools.loadtest.recorder import RequestRecorder, StreamError  # noqa: E402
from tokenflow.tools.loadtest.runner import check_host  # noqa: E402
from tokenflow.tools.loadtest.shapes import add_workload_arguments, schedule_from_args, time_limit  # noqa: E402

CHAT_PATH = "/v1/chat/completions"
LOOKAHEAD_S = 2.0  # spawn users this far ahead: the shape ticks once a second
log = logging.getLogger("tokenflow.loadtest")


class Plan:
    """The run's schedule and bookkeeping, shared by the shape and all users
    (one process, cooperative greenlets: no locks needed)."""

    def __init__(self, opts):
        self.opts = opts
        self.schedule = schedule_from_args(opts)
        self.n = len(self.schedule)
        self.time_limit = time_limit(opts, self.schedule)
        self.t0: float | None = None
        self.claimed = 0
        self.inflight: dict[int, RequestRecorder] = {}  # sent, by arrival slot
        self.reported: set[int] = set()
        self.completed = self.failed = 0
        self.out = open(opts.jsonl, "w", encoding="utf-8")
        self.metrics = ClientMetrics(opts.metrics_port) if opts.metrics_port is not None else None

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def due(self, horizon: float) -> int:
        """Arrivals scheduled at or before `horizon` seconds."""
        return bisect.bisect_right(self.schedule.offsets, horizon)

    def claim(self) -> int | None:
        if self.claimed >= self.n:
            return None
        self.claimed += 1
        return self.claimed - 1

    @property
    def done(self) -> bool:
        return len(self.reported) == self.n

    def report(self, slot: int, record: dict) -> bool:
        """Write one JSON line; False if the slot was already given up on."""
        if slot in self.reported:
            return False
        self.reported.add(slot)
        if record["ok"]:
            self.completed += 1
        else:
            self.failed += 1
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        if self.metrics is not None:
            self.metrics.observe(record, self.opts.model, self.opts.run)
        return True

    def abandon(self, environment, reason: str) -> None:
        """Count every request not yet reported as failed (run stopped early),
        keeping what an in-flight one had received so far."""
        now = time.monotonic()
        for slot in range(self.n):
            rec = self.inflight.get(slot)
            record = {"id": slot, "ok": False, "error": reason, "scheduled_s": self.schedule.offsets[slot],
                      "sent_s": None, "rate": self.schedule.rates[slot], "tokens": 0}
            if rec is not None:
                rec.close(now)
                record.update(sent_s=rec.sent_at - self.t0, **rec.result())
            if self.report(slot, record):
                environment.events.request.fire(
                    request_type="CHAT", name=request_name(record["rate"]),
                    response_time=0.0 if rec is None else (now - rec.sent_at) * 1000, response_length=0,
                    exception=RuntimeError(reason), context={"id": slot})

    def progress(self) -> str:
        streaming = len(self.inflight.keys() - self.reported)
        return (f"[{self.elapsed():6.1f}s] sent {len(self.inflight)}/{self.n}  completed {self.completed}"
                f"  failed {self.failed}  streaming {streaming}")


PLAN: Plan | None = None


def request_name(rate: float) -> str:
    return f"{CHAT_PATH} r={rate:g}"


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    add_workload_arguments(parser)
    parser.add_argument("--jsonl", default=os.environ.get("TOKENFLOW_LOADTEST_JSONL", "requests.jsonl"),
                        help="one JSON line per request is written here")
    parser.add_argument("--no-progress", action="store_true", help="no progress line each second")
    add_metrics_arguments(parser)


@events.init.add_listener
def _init(environment, **_):
    global PLAN
    opts = environment.parsed_options
    if opts is None or not hasattr(opts, "shape"):
        return  # not started from the command line (e.g. an embedding test)
    try:
        check_host(environment.host or StreamingReader.host, opts.allow_remote)
        PLAN = Plan(opts)
    except (ValueError, OSError) as e:
        # Bad options: say so and exit non-zero, as argparse would.
        print(f"locust: error: {e}", file=sys.stderr)
        sys.exit(2)


@events.test_start.add_listener
def _test_start(environment, **_):
    if PLAN is not None and not PLAN.opts.no_progress:
        environment.tokenflow_progress = gevent.spawn(_print_progress)


def _print_progress():
    while True:
        gevent.sleep(1.0)
        print(PLAN.progress(), flush=True)


@events.test_stopping.add_listener
def _test_stopping(environment, **_):
    if PLAN is None:
        return
    PLAN.abandon(environment, "stopped before the answer completed")
    progress = getattr(environment, "tokenflow_progress", None)
    if progress is not None:
        progress.kill(block=False)
    print(PLAN.progress() + "  (run stopped)", flush=True)


class ArrivalShape(LoadTestShape):
    """Users = arrivals due within the lookahead; stop when all are reported."""

    def tick(self):
        plan = PLAN
        plan.start()
        if plan.done:
            return None
        if plan.elapsed() > plan.time_limit:
            plan.abandon(self.runner.environment, f"not finished within the run's {plan.time_limit:g} s limit")
            return None
        users = max(1, plan.due(plan.elapsed() + LOOKAHEAD_S))
        return users, max(100, plan.n)  # spawn rate: all due users at once


class StreamingReader(User):
    host = "http://127.0.0.1:8000"
    wait_time = constant(0)

    def on_start(self):
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy from the environment: talk to --host directly
        self.slot = PLAN.claim()

    def on_stop(self):
        self.session.close()

    @task
    def arrive(self):
        if self.slot is not None:
            slot, self.slot = self.slot, None
            PLAN.start()
            gevent.sleep(max(0.0, PLAN.t0 + PLAN.schedule.offsets[slot] - time.monotonic()))
            self.read_answer(slot)
        # One request per arrival: afterwards (or with no arrival left) the
        # user idles; ending it would let Locust spawn a replacement.
        gevent.sleep(3600)

    def read_answer(self, slot: int) -> None:
        opts, rate = PLAN.opts, PLAN.schedule.rates[slot]
        body = {
            "model": opts.model,
            "messages": [{"role": "user", "content": f"{opts.prompt} (reader {slot})"}],
            "max_tokens": opts.max_tokens,
            "ignore_eos": True,  # fixed output length, as in the paper's workloads
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "consumption_rate": rate,
        }
        rec, nbytes, error = RequestRecorder(rate=rate, sent_at=time.monotonic()), 0, None
        PLAN.inflight[slot] = rec
        try:
            # gevent.Timeout bounds the whole answer; requests' timeout only bounds each read.
            with gevent.Timeout(opts.request_timeout,
                                TimeoutError(f"no complete answer within {opts.request_timeout:g} s")):
                with self.session.post(self.host.rstrip("/") + CHAT_PATH, json=body, stream=True,
                                       timeout=opts.request_timeout) as resp:
                    if resp.status_code != 200:
                        raise StreamError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                    # chunk_size=None: hand over each network chunk as it arrives, so
                    # a line's timestamp is its arrival time, not a buffer fill time.
                    for line in resp.iter_lines(chunk_size=None):
                        nbytes += len(line) + 1
                        if rec.on_line(time.monotonic(), line):
                            break
            if not rec.saw_done:
                raise StreamError("stream ended without [DONE]")
        except Exception as e:  # connection errors, timeouts, HTTP and stream errors: all failures
            error = e
        rec.close(time.monotonic())
        self.report(slot, rec, nbytes, error)

    def report(self, slot: int, rec: RequestRecorder, nbytes: int, error: Exception | None) -> None:
        record = {"id": slot, "ok": error is None,
                  "error": None if error is None else f"{type(error).__name__}: {error}",
                  "scheduled_s": PLAN.schedule.offsets[slot], "sent_s": rec.sent_at - PLAN.t0,
                  **rec.result()}
        if not PLAN.report(slot, record):
            return  # the run was stopped and this request already counted as failed
        name, fire = request_name(rec.reader.rate), self.environment.events.request.fire
        ctx = {"id": slot}
        fire(request_type="CHAT", name=name, response_time=(rec.end_at - rec.sent_at) * 1000,
             response_length=nbytes, exception=error, context=ctx)
        if rec.ttft is not None:
            fire(request_type="TTFT", name=name, response_time=rec.ttft * 1000,
                 response_length=0, exception=None, context=ctx)
        if error is None:
            fire(request_type="STALL", name=name, response_time=rec.stall() * 1000,
                 response_length=0, exception=None, context=ctx)
        if error is not None:
            log.warning("request %d failed: %s", slot, record["error"])
