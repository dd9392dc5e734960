"""Every TokenFlow scheduling knob, in one place, with the paper's defaults.

Deployments set these under `engine_kwargs.additional_config.tokenflow`
(see deployments/configs/*.yaml); unknown keys are an error so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

POLICIES = ("tokenflow", "andes", "fcfs")


def check_keys(cls, d: dict | None, block: str) -> dict:
    """A config block as a dict, refusing keys the dataclass `cls` lacks, so
    a typo never silently falls back to a default."""
    d = dict(d or {})
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {block} keys: {sorted(unknown)}; known: {sorted(known)}")
    return d


def require_positive(obj, names: tuple[str, ...], block: str) -> None:
    """Each named field of `obj` must be a finite number > 0."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{block}.{name} must be a positive number, got {v!r}")


@dataclass
class TokenFlowConfig:
    # Which policy decides: "tokenflow" (the paper), "andes" (the peer
    # baseline), or "fcfs" (the plugin stays out of the way; vLLM decides).
    policy: str = "tokenflow"
    # Reschedule interval dt in seconds. The paper uses 0.5-1.5 s and finds
    # shorter slightly better; between reschedules vLLM batches as usual.
    dt: float = 0.5
    # Buffer conservativeness mu >= 1: a running request may be paused only if
    # its buffer covers mu times its reader's needs while it is away
    # (evict + load + one scheduling interval). Paper tests 1 and 20.
    mu: float = 1.0
    # Weight of the low-buffer penalty gamma * exp(-b / r) in the priority,
    # in tokens: how many useful tokens an empty buffer is worth.
    gamma: float = 50.0
    # Dynamic working-set shrink factor lambda in
    # W_scheduled = W_static - lambda * (W_static - N_running).
    working_set_lambda: float = 0.5
    # Without a host KV tier, how far the working set may exceed device KV
    # memory (as a fraction of it); paused requests beyond it are recomputed.
    recompute_overcommit: float = 1.0
    # Reading rate assumed for requests that state none (tokens/s); the
    # paper's prototype default.
    default_rate: float = 40.0
    # Largest rate a client may state; beyond it the request is rejected.
    max_rate: float = 10_000.0
    # KV blocks kept free for decode growth when packing the running set,
    # as a fraction of the pool (vLLM would otherwise preempt on the next step).
    kv_headroom: float = 0.05
    # Fallback to FCFS when the sum of running readers' rates exceeds this
    # fraction of the measured decode capacity.
    overload_factor: float = 1.0
    # Andes: look-ahead window (s), bonus for already-running requests, and
    # the KV usage at which it starts to act.
    andes_window_s: float = 2.0
    andes_running_bonus: float = 1.5
    andes_kv_trigger: float = 0.9

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        require_positive(self, ("dt", "default_rate", "max_rate"), "tokenflow")
        if self.mu < 1:
            raise ValueError(f"tokenflow.mu must be >= 1, got {self.mu}")

    @classmethod
    def from_dict(cls, d: dict | None) -> "TokenFlowConfig":
        return cls(**check_keys(cls, d, "tokenflow config"))


def parse_rate(value, cfg: TokenFlowConfig) -> float:
    """Validate a client-stated consumption rate (tokens/s); None -> default."""
    if value is None:
        return cfg.default_rate
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("consumption_rate must be a number (tokens/s)")
    try:
        rate = float(value)
    except ValueError:
        raise ValueError("consumption_rate must be a number (tokens/s)") from None
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError("consumption_rate must be a positive, finite number (tokens/s)")
    if rate > cfg.max_rate:
        raise ValueError(f"consumption_rate must be at most {cfg.max_rate:g} tokens/s")
    return rate
