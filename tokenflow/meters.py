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

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


# Token counts are scaled so the fit's columns have like magnitudes.
DECODE_UNIT, PREFILL_UNIT = 64.0, 1024.0


@dataclass
class StepCostFit:
    """step seconds ~= base + per_decode * decode + per_prefill * prefill,
    fitted by exponentially weighted least squares (recent steps count most,
    so the fit follows a changing batch shape)."""

    forget: float = 0.98  # weight kept by a step's sample one step later
    min_samples: int = 8
    # Weighted sums of x x^T and x y over x = (1, decode, prefill), scaled.
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    samples: int = 0
    prefill_samples: int = 0
    _coef: tuple[float, float, float] | None = None
    _stale: bool = True

    def add(self, seconds: float, decode: int, prefill: int) -> None:
        x = (1.0, decode / DECODE_UNIT, prefill / PREFILL_UNIT)
        lam = self.forget
        for i in range(3):
            row = self.xx[i]
            for j in range(3):
                row[j] = lam * row[j] + x[i] * x[j]
            self.xy[i] = lam * self.xy[i] + x[i] * seconds
        self.samples += 1
        self.prefill_samples += prefill > 0
        self._stale = True

    def coef(self) -> tuple[float, float, float] | None:
        """(base s, s per decode token, s per prefill token), or None while
        the steps seen cannot separate them."""
        if self._stale:
            self._stale = False
            self._coef = None
            if self.samples >= self.min_samples:
                sol = _solve3(self.xx, self.xy)
                if sol is not None:
                    self._coef = (sol[0], sol[1] / DECODE_UNIT, sol[2] / PREFILL_UNIT)
        return self._coef


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when near-singular."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(m[i][i]) for i in range(3)) or 1.0
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


@dataclass
class EngineMeters:
    step_rate: Ewma  # steps/s of steps carrying decode = tokens/s a running request gets
    decode_tps: Ewma  # decode tokens/s on decode-only steps
    prefill_tps: Ewma  # prefill tokens/s on prefill-only steps
    fit: StepCostFit
    max_decode_batch: int = 0  # largest decode batch seen
    peak_decode_tps: float = 0.0  # best smoothed decode_tps seen

    @classmethod
    def new(cls) -> "EngineMeters":
        return cls(Ewma(), Ewma(), Ewma(), StepCostFit())

    def on_step(self, seconds: float, decode_tokens: int, prefill_tokens: int) -> None:
        if seconds <= 0 or not (decode_tokens or prefill_tokens):
            return
        self.fit.add(seconds, decode_tokens, prefill_tokens)
        if decode_tokens:
            self.step_rate.add(1.0 / seconds)
            self.max_decode_batch = max(self.max_decode_batch, decode_tokens)
            if not prefill_tokens:
                self.decode_tps.add(decode_tokens / seconds)
                self.peak_decode_tps = max(self.peak_decode_tps, self.decode_tps.value)
        if prefill_tokens and not decode_tokens:
            self.prefill_tps.add(prefill_tokens / seconds)

    @property
    def decode_capacity(self) -> float | None:
        """Decode tokens/s the engine sustains with its largest batch and no
        prefill: the fit's prediction, else the best decode-only step seen."""
        c = self.fit.coef()
        b = self.max_decode_batch
        if c is not None and b and c[0] > 0 and c[1] >= 0:
            return max(b / (c[0] + c[1] * b), self.peak_decode_tps)
        return self.peak_decode_tps or None

    @property
    def prefill_speed(self) -> float | None:
        """Prefill tokens/s: the fit's marginal cost where prefill was seen
        often enough to fit, else prefill-only steps."""
        c = self.fit.coef()
        if c is not None and c[2] > 0 and self.fit.prefill_samples >= self.fit.min_samples:
            return 1.0 / c[2]
        return self.prefill_tps.value
