"""The app's args (`serve run` YAML `args:`, or `key=value` on the command
line): one schema, each field described once. docs/config-schema.json is
generated from it (`tokenflow config-schema`)."""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import Field, field_validator

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.settings import Count, NonNegative, Settings
from tokenflow.serve.guard import AdmissionSettings
from tokenflow.serve.kv_pool import KVPoolSettings
from tokenflow.serve.routing.ranking import RoutingSettings


class AppSettings(Settings):
    """Args of tokenflow.serve.app:build_app."""

    block = "app args"

    model_id: str = Field("tiny-llama", description="The name clients send as \"model\".")
    model_path: str = Field("models/tiny-llama", description="Local model directory (relative paths are taken "
                                                             "from the repo root) or a Hugging Face model id.")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="vLLM's CPU build or CUDA.")
    accelerator_type: str | None = Field(None, description="e.g. \"H100\" (GPU only): pins replicas to that GPU "
                                                           "type.")
    num_replicas: Count = Field(1, description="Engine replicas, one vLLM engine each; or give autoscaling_config.")
    autoscaling_config: dict | None = Field(None, description="Ray Serve autoscaling for the engine deployment "
                                                              "(replaces num_replicas).")
    ingress_replicas: Count = Field(1, description="OpenAI ingress replicas.")
    replica_num_cpus: NonNegative | None = Field(None, description="CPUs reserved for each engine replica actor "
                                                                   "(cpu default 0; gpu: Ray Serve LLM's).")
    ingress_num_cpus: NonNegative | None = Field(None, description="CPUs reserved for each ingress actor (cpu "
                                                                   "default 0).")
    placement_group_config: dict | None = Field(None, description="Engine resources (cpu default {bundles: "
                                                                  "[{CPU: 1}]}).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "Passed to vLLM as they are (AsyncEngineArgs names); when absent on cpu: eager, float32, 2048 context, "
        "64 MiB KV."))
    tokenflow: TokenFlowConfig | None = Field(None, description="The scheduling knobs; they land in "
                                                                "engine_kwargs.additional_config.tokenflow.")
    env: dict[str, str | int | float] = Field(default_factory=dict, description=(
        "Extra environment variables for the replicas and their engine processes (on cpu: LD_PRELOAD of "
        "tcmalloc when installed)."))
    deployment_config: dict[str, Any] = Field(default_factory=dict, description=(
        "Extra Ray Serve options for the engine deployment (e.g. request_router_config, max_ongoing_requests)."))
    experimental_configs: dict[str, Any] = Field(default_factory=dict, description=(
        "Ray Serve LLM extras (e.g. stream_batching_interval_ms)."))
    router: RoutingSettings = Field(default_factory=RoutingSettings, description=(
        "Slack-aware request routing; a request_router_config in deployment_config wins over it."))
    kv_pool: KVPoolSettings = Field(default_factory=KVPoolSettings, description="Node host-KV pool actors.")
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings, description="The ingress's front door.")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        # `key: null` in YAML means "the default", as if the key were absent.
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value


# Per-accelerator defaults, for args not given. On CPU everything but the
# engine itself asks for 0 CPUs: Ray's defaults (1 CPU per replica actor on
# top of its engine's bundle, 1 more for the ingress) leave a second replica
# pending forever on a 2-core machine, with no error.
# VLLM_CPU_OMP_THREADS_BIND=nobind stops two engines from pinning their
# OpenMP threads onto the same cores. VLLM_CPU_KVCACHE_SPACE is deliberately
# not set: when present it overrides engine_kwargs.kv_cache_memory_bytes (and
# only in whole GiB).
ACCELERATOR_DEFAULTS = {
    "cpu": {
        "replica_num_cpus": 0,
        "ingress_num_cpus": 0,
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        # Used only when args give no engine_kwargs at all. Without an explicit
        # KV size vLLM's CPU backend reserves gpu_memory_utilization (0.92) of
        # the NUMA node's RAM and refuses to start when that much is not free.
        "engine_kwargs": {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32",
                          "kv_cache_memory_bytes": 64 * 2**20},
    },
    # GPU: Ray Serve LLM's own defaults ({GPU: 1} per TP x PP worker, 1 CPU
    # for the replica actor) are right.
    "gpu": {},
}


def resolve(args: dict | None, tcmalloc: str | None = None) -> dict:
    """Validated args as a plain dict: accelerator defaults for what is not
    given, the tokenflow block moved into engine_kwargs, router.reader_rate
    defaulting to the tokenflow block's default_rate."""
    s = AppSettings.from_dict(args)
    given = {k for k in s.model_fields_set if (args or {}).get(k) is not None}
    out = s.model_dump(exclude={"tokenflow"})
    for key, value in ACCELERATOR_DEFAULTS[s.accelerator].items():
        if key not in given:
            out[key] = copy.deepcopy(value)
        elif key == "env":  # extend, not replace, the accelerator's env vars
            out[key] = {**value, **out[key]}
    if s.accelerator == "cpu" and tcmalloc:
        out["env"].setdefault("LD_PRELOAD", tcmalloc)
    tokenflow = s.tokenflow.model_dump(exclude_unset=True) if s.tokenflow is not None else None
    out["engine_kwargs"] = merge_tokenflow_config(out["engine_kwargs"], tokenflow)
    if out["router"]["reader_rate"] is None:
        # A newcomer is assumed to read at the rate the scheduler assumes.
        block = (out["engine_kwargs"].get("additional_config") or {}).get("tokenflow")
        out["router"]["reader_rate"] = TokenFlowConfig.from_dict(block).default_rate
    return out


def merge_tokenflow_config(engine_kwargs: dict, tokenflow: dict | None) -> dict:
    """Put the `tokenflow` block where the scheduler (inside the EngineCore
    process) and the replica both read it: additional_config.tokenflow."""
    engine_kwargs = copy.deepcopy(engine_kwargs or {})
    additional = dict(engine_kwargs.get("additional_config") or {})
    if tokenflow is not None:
        if "tokenflow" in additional and additional["tokenflow"] != tokenflow:
            raise ValueError("tokenflow config given both as args.tokenflow and "
                             "engine_kwargs.additional_config.tokenflow; keep one")
        additional["tokenflow"] = tokenflow
    # Validate now (typos, bad values) rather than minutes later in an engine.
    TokenFlowConfig.from_dict(additional.get("tokenflow"))
    if additional:
        engine_kwargs["additional_config"] = additional
    return engine_kwargs


def json_schema() -> str:
    return json.dumps(AppSettings.model_json_schema(), indent=2, sort_keys=True) + "\n"
