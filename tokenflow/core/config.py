"""Every TokenFlow scheduling knob, in one place, with the paper's defaults.

Deployments set these under `tokenflow:` in the app args, which lands in
`engine_kwargs.additional_config.tokenflow` (see configs/*.yaml).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from tokenflow.core.settings import Fraction, NonNegative, Positive, Settings

POLICIES = ("tokenflow", "andes", "fcfs")


class TokenFlowConfig(Settings):
    block = "tokenflow"

    policy: Literal["tokenflow", "andes", "fcfs"] = Field(
        "tokenflow", description="Which policy decides: tokenflow (the paper), andes (the peer baseline), or fcfs "
                                 "(the plugin stays out of the way; vLLM decides).")
    dt: Positive = Field(0.5, description="Reschedule interval in seconds. The paper uses 0.5-1.5 s and finds "
                                          "shorter slightly better; between reschedules vLLM batches as usual.")
    mu: float = Field(1.0, ge=1, allow_inf_nan=False,
                      description="Buffer conservativeness mu >= 1: a running request may be paused only if its "
                                  "buffer covers mu times its reader's needs while it is away (evict, load, one "
                                  "interval). The paper tests 1 and 20.")
    gamma: NonNegative = Field(50.0, description="Weight of the low-buffer penalty gamma * exp(-b / r) in the "
                                                 "priority, in tokens: what an empty buffer is worth.")
    working_set_lambda: Fraction = Field(
        0.5, description="Working-set shrink factor lambda in W_scheduled = W_static - lambda * (W_static - "
                         "N_running).")
    recompute_overcommit: NonNegative = Field(
        1.0, description="Without a host KV tier, how far the working set may exceed device KV memory (as a "
                         "fraction of it); paused requests beyond it are recomputed.")
    default_rate: Positive = Field(40.0, description="Reading rate (tokens/s) assumed for requests that state "
                                                     "none; the paper's prototype default.")
    min_rate: Positive = Field(0.5, description="Smallest reading rate (tokens/s) a client may state; below it "
                                                "the request is rejected (a reader that slow would be parked "
                                                "for good under contention while it holds a slot).")
    max_rate: Positive = Field(10_000.0, description="Largest reading rate (tokens/s) a client may state; beyond "
                                                     "it the request is rejected. A reader faster than the engine "
                                                     "serves one request counts as needing that speed only.")
    kv_headroom: Fraction = Field(0.05, description="KV blocks kept free for decode growth when packing the "
                                                    "running set, as a fraction of the pool.")
    overload_factor: Positive | None = Field(
        None, description="Fall back to FCFS (the paper's step 2: earliest arrivals first, later readers pause for "
                          "them) when the readers' rates together exceed this fraction of the measured decode "
                          "capacity. None (the default): no fallback; past capacity a reader gives its slot to "
                          "one run dry only once its own next tokens count for less, and a newcomer's first "
                          "token goes ahead of every reader with something left to read.")
    andes_window_s: Positive = Field(2.0, description="Andes: look-ahead window (s).")
    andes_running_bonus: NonNegative = Field(1.5, description="Andes: bonus for already-running requests.")
    andes_kv_trigger: Fraction = Field(0.9, description="Andes: the KV usage at which it starts to act.")

    @model_validator(mode="after")
    def _rates_ordered(self) -> "TokenFlowConfig":
        if not self.min_rate <= self.default_rate <= self.max_rate:
            raise ValueError(f"need min_rate <= default_rate <= max_rate, got {self.min_rate:g}, "
                             f"{self.default_rate:g}, {self.max_rate:g}")
        return self


DEFAULT_RATE = TokenFlowConfig.model_fields["default_rate"].default

# The `vllm_xargs` key (and top-level body field) of a reader's rate.
RATE_KEY = "consumption_rate"

# A top-level body field: `false` opts a stream out of continuation (a
# client that wants an error rather than a splice, e.g. to keep a seeded
# sampler's one random stream); the ingress answers 400 to anything but a
# JSON boolean.
CONTINUATION_KEY = "tokenflow_continuation"

# A top-level body field: the engine id (GET /v1/tokenflow/engines) a request
# must go to, when the app's admission.engine_pinning allows it (to test one
# engine, or pile a workload onto one); else 400.
PIN_KEY = "tokenflow_engine"

# `vllm_xargs` keys of a stream continued from a lost engine
# (tokenflow/serve/continuation.py): its reader's unread tokens when it was
# handed over, and the seconds since the client sent it. The scheduler ranks
# it by when that buffer runs dry, like a paused request. SENT_KEY: how many
# of the prompt's last ids are the answer's, sent already (the replica may
# cut some of them off to be generated again).
CARRIED_KEY = "tokenflow_carried_tokens"
WAITED_KEY = "tokenflow_waited_s"
SENT_KEY = "tokenflow_sent_tokens"
# A top-level body field: `false` keeps a stream on its engine when that
# engine moves paused streams to engines with slack (it is still continued
# if its engine is lost); 400 to anything but a JSON boolean.
REBALANCE_KEY = "tokenflow_rebalance"

# `vllm_xargs` key the ingress sets (to 1) on a stream it can still continue
# elsewhere and that did not opt out of moves: only such a stream may be
# moved off a busy engine.
MOVABLE_KEY = "tokenflow_movable"


def parse_carried(xargs: dict | None) -> tuple[float, float] | None:
    """(unread tokens, seconds waited) of a continued stream; None for any
    other request, or when the values are not finite numbers >= 0."""
    if not xargs or CARRIED_KEY not in xargs:
        return None
    try:
        unread, waited = float(xargs[CARRIED_KEY]), float(xargs.get(WAITED_KEY, 0.0))
    except (TypeError, ValueError):
        return None
    ok = all(math.isfinite(v) and v >= 0 for v in (unread, waited))
    return (unread, waited) if ok else None


def stated_rate(body, default: float) -> float:
    """The reader's rate a request body states (top level, else in
    vllm_xargs), as the replica will read it; `default` when it states none
    or a bad one (a bad one is the replica's to reject with a 400)."""
    value = (getattr(body, "model_extra", None) or {}).get(RATE_KEY)
    if value is None:
        value = (getattr(body, "vllm_xargs", None) or {}).get(RATE_KEY)
    try:
        rate = float(value) if value is not None and not isinstance(value, bool) else default
    except (TypeError, ValueError):
        return default
    return rate if 0 < rate < math.inf else default


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
    if rate < cfg.min_rate:
        raise ValueError(f"consumption_rate must be at least {cfg.min_rate:g} tokens/s")
    if rate > cfg.max_rate:
        raise ValueError(f"consumption_rate must be at most {cfg.max_rate:g} tokens/s")
    return rate
