"""Engine speed estimates the policy needs, learned from the steps it sees.

Pure Python: the scheduler adapter feeds it each step's duration and token
counts; the policy reads smoothed figures. Unknown stays None until seen, so
the policy never acts on a made-up number.

On a GPU with chunked prefill almost every step mixes decode and prefill
tokens, so nothing here needs decode-only steps: a running request's speed
is measured on every step it is in, and the engine's decode capacity and
prefill speed come from a least-squares fit of step time against both token
counts (`StepCostFit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ewma:
    alpha: float = 0.2
    value: float | None = None
    count: int = 0  # samples added

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.count += 1

    @property
    def settled(self) -> bool:
        """Whether the first sample weighs under a tenth of the value (12
        samples at alpha 0.2). Before that the value is mostly its first
        samples, and an engine's first decode steps run cold and crowded (a
        burst's first steps also prefill most of it): 7 steps/s, where the
        same engine's warm steps later ran 138."""
        return self.count > 0 and (1.0 - self.alpha) ** (self.count - 1) < 0.1


# Token counts are scaled so the fit's columns have like magnitudes.
DECODE_UNIT, PREFILL_UNIT, STARTS_UNIT = 64.0, 1024.0, 16.0


@dataclass
class StepCostFit:
    """step seconds ~= base + per_decode * decode + per_prefill * prefill,
    fitted by exponentially weighted least squares (recent steps count most,
    so the fit follows a changing batch shape). The sums also hold a fourth
    column, the requests whose prefill the step starts or resumes, for the
    fixed cost of each (`start_cost`)."""

    forget: float = 0.98  # weight kept by a step's sample one step later
    min_samples: int = 8
    # Weighted sums of x x^T and x y over x = (1, decode, prefill, starts), scaled.
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 4)
    samples: int = 0
    prefill_samples: int = 0
    _coef: tuple[float, float, float] | None = None
    _stale: bool = True
    _start: tuple[float, float] | None = None
    _start_stale: bool = True  # both read once a decision; solved again only after a new step

    def add(self, seconds: float, decode: int, prefill: int, starts: int = 0) -> None:
        x = (1.0, decode / DECODE_UNIT, prefill / PREFILL_UNIT, starts / STARTS_UNIT)
        lam = self.forget
        for i in range(4):
            row = self.xx[i]
            for j in range(4):
                row[j] = lam * row[j] + x[i] * x[j]
            self.xy[i] = lam * self.xy[i] + x[i] * seconds
        self.samples += 1
        self.prefill_samples += prefill > 0
        self._stale = self._start_stale = True

    def coef(self) -> tuple[float, float, float] | None:
        """(base s, s per decode token, s per prefill token), or None while
        the steps seen cannot separate them: a token budget that prefill
        fills to the brim every step makes prefill = budget - decode, and
        then only base + prefill cost together can be known (`coef2`)."""
        if self._stale:
            self._stale = False
            self._coef = None
            if self.samples >= self.min_samples:
                sol = _solve([row[:3] for row in self.xx[:3]], self.xy[:3])
                if sol is not None and sol[0] > 0 and sol[1] >= 0 and sol[2] > 0:
                    self._coef = (sol[0], sol[1] / DECODE_UNIT, sol[2] / PREFILL_UNIT)
        return self._coef

    def start_cost(self) -> tuple[float, float] | None:
        """(s per prefill token, s per request started) from all four
        columns: what a resume adds to its step beyond its tokens (the
        scheduler's and the runner's per-request work). None while the
        steps seen cannot tell starts from prefill tokens."""
        if self._start_stale:
            self._start_stale = False
            self._start = None
            if self.prefill_samples >= self.min_samples:
                sol = _solve(self.xx, self.xy)
                if sol is not None and sol[0] > 0 and sol[2] > 0 and sol[3] >= 0:
                    self._start = (sol[2] / PREFILL_UNIT, sol[3] / STARTS_UNIT)
        return self._start

    def coef2(self) -> tuple[float, float] | None:
        """(s per step, s per decode token) with the prefill done alongside
        counted in the per-step cost: what decoding costs at the current
        prefill load."""
        if self.samples < self.min_samples:
            return None
        sol = _solve([row[:2] for row in self.xx[:2]], self.xy[:2])
        if sol is None or sol[0] <= 0 or sol[1] < 0:
            return None
        return sol[0], sol[1] / DECODE_UNIT


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when near-singular
    (a pivot under 1e-6 of the largest diagonal entry)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(m[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-6 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class EngineMeters:
    step_rate: Ewma  # steps/s of steps carrying decode = tokens/s a running request gets
    decode_tps: Ewma  # decode tokens/s on decode-only steps
    prefill_tps: Ewma  # prefill tokens/s on prefill-only steps
    fit: StepCostFit
    max_decode_batch: int = 0  # largest decode batch seen
    peak_decode_tps: float = 0.0  # best smoothed decode_tps seen
    peak_step_rate: float = 0.0  # best settled step_rate seen: the most one request gets here; 0: not yet

    @classmethod
    def new(cls) -> "EngineMeters":
        return cls(Ewma(), Ewma(), Ewma(), StepCostFit())

    def on_step(self, seconds: float, decode_tokens: int, prefill_tokens: int, starts: int = 0) -> None:
        """One step: its seconds, its decode tokens, its prefill tokens and
        the requests among them whose prefill began this step."""
        if seconds <= 0 or not (decode_tokens or prefill_tokens):
            return
        self.fit.add(seconds, decode_tokens, prefill_tokens, starts)
        if decode_tokens:
            self.step_rate.add(1.0 / seconds)
            if self.step_rate.settled:
                self.peak_step_rate = max(self.peak_step_rate, self.step_rate.value)
            self.max_decode_batch = max(self.max_decode_batch, decode_tokens)
            if not prefill_tokens:
                self.decode_tps.add(decode_tokens / seconds)
                self.peak_decode_tps = max(self.peak_decode_tps, self.decode_tps.value)
        if prefill_tokens and not decode_tokens:
            self.prefill_tps.add(prefill_tokens / seconds)

    @property
    def decode_capacity(self) -> float | None:
        """Decode tokens/s the engine sustains with its largest batch: with
        no prefill where the fit can tell, else at the current prefill load
        (a lower bound), and never below the best decode-only step seen."""
        b = self.max_decode_batch
        if not b:
            return self.peak_decode_tps or None
        c = self.fit.coef()
        if c is not None:
            return max(b / (c[0] + c[1] * b), self.peak_decode_tps)
        c2 = self.fit.coef2()
        if c2 is not None:
            return max(b / (c2[0] + c2[1] * b), self.peak_decode_tps)
        return self.peak_decode_tps or None

    @property
    def decode_step_cost(self) -> tuple[float, float] | None:
        """(s per step, s per decode token) of a decode step: the fit without
        prefill where it can tell, else at the current prefill load."""
        c = self.fit.coef()
        return (c[0], c[1]) if c is not None else self.fit.coef2()

    @property
    def start_seconds(self) -> float | None:
        """Step seconds each request (re)added to the batch costs beyond its
        prefill tokens; None until the steps seen can tell."""
        c = self.fit.start_cost()
        return c[1] if c is not None else None

    @property
    def prefill_speed(self) -> float | None:
        """Prefill tokens/s: the fit's marginal cost where prefill was seen
        often enough to fit, else prefill-only steps."""
        c = self.fit.coef()
        if c is not None and self.fit.prefill_samples >= self.fit.min_samples:
            return 1.0 / c[2]
        return self.prefill_tps.value
