"""Engine speed estimates the policy needs, learned from the steps it sees.

Pure Python: the scheduler adapter feeds it each step's duration and token
counts; the policy reads smoothed figures. Unknown stays None until seen, so
the policy never acts on a made-up number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ewma:
    alpha: float = 0.2
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class EngineMeters:
    step_rate: Ewma  # decode steps/s (each running request gains ~1 token a step)
    decode_tps: Ewma  # decode tokens/s the engine sustains at its current batch
    prefill_tps: Ewma  # prefill tokens/s in steps that carried prefill
    peak_decode_tps: float = 0.0  # capacity estimate: best decode throughput seen

    @classmethod
    def new(cls) -> "EngineMeters":
        return cls(Ewma(), Ewma(), Ewma())

    def on_step(self, seconds: float, decode_tokens: int, prefill_tokens: int) -> None:
        if seconds <= 0:
            return
        if prefill_tokens:
            self.prefill_tps.add(prefill_tokens / seconds)
        elif decode_tokens:
            self.step_rate.add(1.0 / seconds)
            tps = decode_tokens / seconds
            self.decode_tps.add(tps)
            self.peak_decode_tps = max(self.peak_decode_tps, self.decode_tps.value or 0.0)
