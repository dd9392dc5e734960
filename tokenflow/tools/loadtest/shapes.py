"""Arrival schedules and reading-rate mixes (pure Python, seeded).

A schedule fixes, before the run, when each request arrives (seconds after
the start) and the reading rate its user states. The Locust shape only
spawns users ahead of those times; each user waits for its own arrival time,
so arrivals follow the schedule to the millisecond rather than Locust's
one-second shape tick.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

SHAPES = ("burst", "bursts", "poisson", "gamma")
MAX_REQUESTS = 10_000  # a bound on one run, not a limit of the method


def parse_rates(text: str) -> list[tuple[float, float]]:
    """`10:0.5,20:0.3,40:0.2` -> [(10, 0.5), (20, 0.3), (40, 0.2)] (value:weight).

    A bare value has weight 1, so `20` means every reader reads 20 tokens/s."""
    mix = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in rate mix {text!r} (expected value:weight,...)")
        value_s, _, weight_s = part.partition(":")
        try:
            value = float(value_s)
            weight = float(weight_s) if weight_s.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad rate entry {part!r} in {text!r} (expected value:weight, e.g. 20:0.5)") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"reading rate must be a positive number of tokens/s, got {value_s!r}")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"rate weight must be a non-negative number, got {weight_s!r}")
        mix.append((value, weight))
    if sum(w for _, w in mix) <= 0:
        raise ValueError(f"rate weights in {text!r} sum to zero")
    return mix


def mean_rate(mix: list[tuple[float, float]]) -> float:
    """The mix's reading rate on average over its readers (weights as drawn)."""
    return sum(v * w for v, w in mix) / sum(w for _, w in mix)


def draw_rates(mix: list[tuple[float, float]], n: int, seed: int = 0) -> list[float]:
    """Each rate for its share of the n readers, as near as whole readers
    allow (largest remainders first), in an order shuffled by `seed`.
    Independent draws left a burst's readers needing up to a fifth more or
    less than the mix's mean rate says (64 readers, one seed in three), so
    one command met another load with each seed."""
    total = sum(w for _, w in mix)
    quotas = [n * w / total for _, w in mix]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(mix)), key=lambda i: quotas[i] - counts[i], reverse=True)
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    rates = [v for (v, _), c in zip(mix, counts) for _ in range(c)]
    random.Random(seed).shuffle(rates)
    return rates


def arrival_offsets(shape: str, n: int, *, arrival_rate: float | None = None, cv: float = 1.0,
                    bursts: int = 1, period: float | None = None, seed: int = 0) -> list[float]:
    """Arrival times in seconds after the start, ascending, the first at 0.

    burst:   all n at once.
    bursts:  n / bursts requests at once, every `period` seconds, `bursts` times.
    poisson: exponential gaps, mean 1 / arrival_rate.
    gamma:   gamma gaps with the same mean and coefficient of variation `cv`
             (cv = 1 is Poisson; larger is burstier, as in BurstGPT traces).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
    if not 1 <= n <= MAX_REQUESTS:
        raise ValueError(f"requests must be between 1 and {MAX_REQUESTS}, got {n}")
    if shape == "burst":
        return [0.0] * n
    if shape == "bursts":
        if bursts < 1 or n % bursts:
            raise ValueError(f"--requests ({n}) must be a multiple of --bursts ({bursts})")
        if period is None or not (period > 0 and math.isfinite(period)):
            raise ValueError("shape 'bursts' needs --period > 0 (seconds between bursts)")
        size = n // bursts
        return [k * period for k in range(bursts) for _ in range(size)]
    if arrival_rate is None or not (arrival_rate > 0 and math.isfinite(arrival_rate)):
        raise ValueError(f"shape {shape!r} needs --arrival-rate > 0 (requests/s)")
    if shape == "gamma" and not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"--cv must be a positive number, got {cv}")
    rng = random.Random(seed)
    # Gamma with shape k = 1/cv^2 and scale cv^2/rate: mean gap 1/rate, CV = cv.
    k = 1.0 if shape == "poisson" else 1.0 / (cv * cv)
    scale = 1.0 / (arrival_rate * k)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(k, scale)
    return out


@dataclass(frozen=True)
class Schedule:
    offsets: list[float]  # arrival time of request i, seconds after the start
    rates: list[float]  # reading rate (tokens/s) the user of request i states

    def __len__(self) -> int:
        return len(self.offsets)


def make_schedule(shape: str, requests: int, rates: str | list[tuple[float, float]], *,
                  arrival_rate: float | None = None, cv: float = 1.0, bursts: int = 1,
                  period: float | None = None, seed: int = 0) -> Schedule:
    """Validate everything about a workload and fix it; ValueError says what is wrong."""
    mix = parse_rates(rates) if isinstance(rates, str) else rates
    offsets = arrival_offsets(shape, requests, arrival_rate=arrival_rate, cv=cv, bursts=bursts,
                              period=period, seed=seed)
    # A separate stream for rates, so changing the shape keeps each request's rate.
    return Schedule(offsets=offsets, rates=draw_rates(mix, requests, seed=seed + 1))


# --- command-line options, shared by `tokenflow loadtest` and the locustfile ---

DEFAULT_PROMPT = "Tell me a long story about a river and the people who live along it."


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


def _rate_mix(s: str) -> str:
    """Checked here for a clear argparse message; kept as text to pass on to Locust."""
    try:
        parse_rates(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def add_workload_arguments(parser) -> None:
    """Options that define the workload. Works on argparse and on Locust's parser."""
    parser.add_argument("--model", default="tiny-llama", help="model name sent with each request")
    parser.add_argument("--shape", choices=SHAPES, default="burst",
                        help="burst: all at once; bursts: --bursts K of them, --period apart; "
                             "poisson / gamma: at --arrival-rate, gamma with --cv burstiness")
    parser.add_argument("--requests", type=_positive_int, default=20, help="total requests in the run")
    parser.add_argument("--rates", type=_rate_mix, default="10:0.5,20:0.3,40:0.2",
                        help="reading-rate mix, tokens/s value:weight,... (one drawn per request)")
    parser.add_argument("--arrival-rate", type=_positive_float, default=None,
                        help="requests/s for --shape poisson or gamma")
    parser.add_argument("--cv", type=_positive_float, default=2.0,
                        help="coefficient of variation of gaps for --shape gamma (1 = Poisson)")
    parser.add_argument("--bursts", type=_positive_int, default=2, help="number of bursts for --shape bursts")
    parser.add_argument("--period", type=_positive_float, default=None,
                        help="seconds between burst starts for --shape bursts")
    parser.add_argument("--max-tokens", type=_positive_int, default=128,
                        help="output tokens per request (EOS ignored, so every answer has this length)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and rate draws")
    parser.add_argument("--request-timeout", type=_positive_float, default=120.0,
                        help="seconds one streamed answer may take before it counts as failed")
    parser.add_argument("--time-limit", type=_positive_float, default=None,
                        help="seconds before the run stops by itself (default: last arrival "
                             "+ --request-timeout + 30)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a --host that is not a loopback address")


def schedule_from_args(args) -> Schedule:
    return make_schedule(args.shape, args.requests, args.rates, arrival_rate=args.arrival_rate,
                         cv=args.cv, bursts=args.bursts, period=args.period, seed=args.seed)


def time_limit(args, schedule: Schedule) -> float:
    return args.time_limit or schedule.offsets[-1] + args.request_timeout + 30.0
