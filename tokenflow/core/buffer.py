"""The one model of a streaming reader's buffer.

Every part of TokenFlow that reasons about a user (the scheduler, the server
metrics, the Locust client and the benchmark) uses this module, so the
server's and the client's accounting agree by construction.

Playback model (paper, "The user model"): the reader starts at the first
token and consumes `rate` tokens/s while anything is buffered; with an empty
buffer before the answer is complete, the reader stalls. The playhead is a
continuous position in tokens, so all quantities are exact piecewise-linear
functions of the arrival times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Effective throughput (paper, Metrics): a token counts fully while the buffer
# at its arrival is below LOW of the output length, falls linearly to zero at HIGH.
EFFECTIVE_LOW_FRACTION = 0.10
EFFECTIVE_HIGH_FRACTION = 0.20


def token_weight(buffer_tokens: float, output_len: int) -> float:
    """Weight of one token that arrives while `buffer_tokens` are unread."""
    low = EFFECTIVE_LOW_FRACTION * output_len
    high = EFFECTIVE_HIGH_FRACTION * output_len
    if buffer_tokens <= low:
        return 1.0
    if buffer_tokens >= high:
        return 0.0
    return (high - buffer_tokens) / (high - low)


def interval_worth(level, count, read, output_len):
    """What `count` tokens, sent evenly through an interval in which the
    reader reads `read` of them, add to effective throughput when its
    buffer starts the interval at `level`: their token_weight summed, each
    at the level it arrives at. numpy arrays or numbers, element-wise."""
    low = EFFECTIVE_LOW_FRACTION * output_len
    high = EFFECTIVE_HIGH_FRACTION * output_len
    span = np.maximum(high - low, 1e-9)

    def area(x):  # the weight summed over a buffer climbing from 0 to x
        over = np.clip(x - low, 0.0, span)
        return np.minimum(x, low) + over - over * over / (2.0 * span)

    # Each token sent lifts the level by what is not read meanwhile.
    rise = np.maximum(1.0 - read / np.maximum(count, 1e-9), 0.0)
    climbed = (area(level + count * rise) - area(level)) / np.maximum(rise, 1e-9)
    flat = count * np.clip((high - level) / span, 0.0, 1.0)  # a level that does not climb
    return np.where(rise > 1e-6, climbed, flat)


def paper_token_weight(buffer_tokens: float, tau: float, alpha: float) -> float:
    """Paper Eq. 1: w = 1 if B <= tau else max(1 - alpha * (B - tau), 0)."""
    if buffer_tokens <= tau:
        return 1.0
    return max(1.0 - alpha * (buffer_tokens - tau), 0.0)


@dataclass
class ReaderBuffer:
    """One request seen from its reader. Feed arrivals in time order."""

    rate: float  # tokens/s the reader consumes
    arrival_time: float  # when the request was sent
    first_token_time: float | None = None
    delivered: int = 0
    finished: bool = False
    # Keep each token's arrival time and buffer level (the metrics below
    # need them); the scheduler only asks for levels, so it keeps none.
    history: bool = True
    # Playhead state, advanced lazily by _advance().
    _position: float = 0.0
    _clock: float = 0.0
    _stall: float = 0.0
    # When the buffer runs out if nothing more arrives (-inf before the
    # first token): the level at t is rate * (dry_at - t) until then, and it
    # moves only when tokens arrive, so a scheduler reads every reader's
    # level from one array of these (tokenflow/engine/scheduler.py).
    dry_at: float = -math.inf
    # Buffer level seen by each token as it arrived (before adding it).
    arrivals: list[float] = field(default_factory=list)
    buffer_at_arrival: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"consumption rate must be a positive number, got {self.rate!r}")

    @classmethod
    def continued(cls, rate: float, now: float, unread: float, waited: float = 0.0,
                  history: bool = True) -> "ReaderBuffer":
        """A reader who began this answer elsewhere (a stream continued from a
        lost engine), sent it `waited` seconds ago and holds `unread` tokens
        at `now`: it reads on from there, and stalls when they run out before
        new tokens come."""
        r = cls(rate=rate, arrival_time=now - waited, history=history)
        r.first_token_time = r._clock = now
        r.delivered = math.ceil(max(0.0, unread))
        r._position = r.delivered - max(0.0, unread)
        r.dry_at = now + max(0.0, unread) / rate
        return r

    @classmethod
    def replay(cls, rate: float, arrival_time: float, arrivals: list[float]) -> "ReaderBuffer":
        """A reader fed one token at each of `arrivals` (a recorded run's token times)."""
        r = cls(rate=rate, arrival_time=arrival_time)
        for t in arrivals:
            r.on_tokens(t)
        return r

    def _advance(self, t: float) -> None:
        if self.first_token_time is None or t <= self._clock:
            return
        dt = t - self._clock
        room = self.delivered - self._position
        if room >= self.rate * dt:
            self._position += self.rate * dt
        else:
            self._position = float(self.delivered)
            if not self.finished:
                self._stall += dt - room / self.rate
        self._clock = t

    def on_tokens(self, t: float, n: int = 1) -> None:
        """`n` tokens arrive together at time `t`."""
        if n <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = t
            self._clock = t
        self._advance(t)
        if not self.history:
            self.delivered += n
        else:
            for _ in range(n):
                self.buffer_at_arrival.append(self.delivered - self._position)
                self.arrivals.append(t)
                self.delivered += 1
        self.dry_at = self._clock + (self.delivered - self._position) / self.rate

    def on_finish(self, t: float) -> None:
        self._advance(t)
        self.finished = True

    # --- queries -------------------------------------------------------
    def buffer(self, t: float) -> float:
        """Tokens delivered but not yet read at time t."""
        self._advance(t)
        return self.delivered - self._position

    def level(self, t: float) -> float:
        """buffer(t) without advancing the playhead, from `dry_at` alone: the
        scheduler's snapshot computes this for every live request at once
        (rate * (dry_at - t), at least 0). Advancing later over the longer
        span gives the same position and stall (no token arrived in
        between: on_tokens advances first)."""
        if self.first_token_time is None:
            return self.delivered - self._position
        room = self.rate * (self.dry_at - t)
        return room if room > 0.0 else 0.0

    def buffer_seconds(self, t: float) -> float:
        return self.buffer(t) / self.rate

    def consumed(self, t: float) -> float:
        self._advance(t)
        return self._position

    def stall_time(self, t: float) -> float:
        self._advance(t)
        return self._stall

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def tbts(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def weights(self, output_len: int | None = None) -> list[float]:
        """Effective-throughput weight of every delivered token."""
        n = output_len if output_len is not None else self.delivered
        return [token_weight(b, n) for b in self.buffer_at_arrival]

    def effective_tokens(self, output_len: int | None = None) -> float:
        return sum(self.weights(output_len))

    def qoe(self, expected_ttft: float = 1.0) -> float:
        """Andes QoE: area under the tokens-read curve over the area under the
        expected curve (first token at expected_ttft, then one every 1/rate),
        both integrated up to when the reader finishes; capped at 1."""
        if not self.arrivals:
            return 0.0
        end = _playback_end(self.arrivals, self.rate)
        actual = _playback_area(self.arrivals, self.rate, self.arrival_time, end)
        n = len(self.arrivals)
        expected = _ramp_area(self.arrival_time + expected_ttft, self.rate, n, end)
        if expected <= 0:
            return 1.0
        return min(1.0, actual / expected)


def _playback_end(arrivals: list[float], rate: float) -> float:
    """Time the reader reads the last token."""
    t, pos = arrivals[0], 0.0
    for i, a in enumerate(arrivals):
        if a > t:
            # reader may have caught up with delivered == i tokens
            pos = min(float(i), pos + rate * (a - t))
            t = a
    return t + (len(arrivals) - pos) / rate


def _ramp_area(start: float, rate: float, n: int, end: float) -> float:
    """Integral over [start, end] of min(n, rate * (t - start))."""
    if end <= start:
        return 0.0
    full = n / rate
    span = end - start
    if span <= full:
        return 0.5 * rate * span * span
    return 0.5 * n * full + n * (span - full)


def _playback_area(arrivals: list[float], rate: float, t0: float, end: float) -> float:
    """Integral of the playhead position from t0 to end (zero before the first token)."""
    area, t, pos = 0.0, arrivals[0], 0.0
    bounds = arrivals[1:] + [end]
    for i, nxt in enumerate(bounds, start=1):
        # between t and nxt, i tokens are delivered
        nxt = max(nxt, t)
        catch_up = (i - pos) / rate
        if t + catch_up >= nxt:
            dt = nxt - t
            area += pos * dt + 0.5 * rate * dt * dt
            pos += rate * dt
        else:
            area += pos * catch_up + 0.5 * rate * catch_up * catch_up
            area += i * (nxt - t - catch_up)
            pos = float(i)
        t = nxt
    return area


def buffer_at(arrivals: list[float], rate: float, t: float) -> float:
    """Buffer level at time t of a reader who got tokens at `arrivals`."""
    r = ReaderBuffer(rate=rate, arrival_time=arrivals[0] if arrivals else 0.0)
    for a in arrivals:
        if a > t:
            break
        r.on_tokens(a)
    return r.buffer(t)


def effective_throughput(buffers: list[ReaderBuffer], wall_time: float) -> float:
    """Sum of token weights over all requests divided by wall time."""
    if wall_time <= 0:
        return 0.0
    return sum(b.effective_tokens() for b in buffers) / wall_time
