"""The TokenFlow Ray Serve application: an OpenAI-compatible API on vLLM.

    serve run deployments/configs/local.yaml          # CPU, tiny model
    serve run deployments.app:build_app model_path=... # args as key=value

Built on `ray.serve.llm` (OpenAI ingress -> N x TokenFlowLLMServer replicas,
one vLLM engine each). Args (all optional, unknown keys are an error so a
typo never silently falls back to a default):

  model_id             name clients send as "model" (default "tiny-llama")
  model_path           local model dir; relative paths are taken from the repo root
  accelerator          "cpu" (default) or "gpu"
  accelerator_type     e.g. "H100" (GPU only; pins replicas to that GPU type)
  num_replicas         engine replicas (default 1); or give autoscaling_config
  autoscaling_config   Ray Serve autoscaling for the engine deployment
  ingress_replicas     OpenAI ingress replicas (default 1)
  replica_num_cpus     CPUs reserved for each replica actor (cpu default 0)
  ingress_num_cpus     CPUs reserved for each ingress actor (cpu default 0)
  placement_group_config  engine resources (cpu default {bundles: [{CPU: 1}]})
  engine_kwargs        passed straight to vLLM (AsyncEngineArgs field names);
                       if absent on cpu: eager, 2048 context, 64 MiB KV
  tokenflow            TokenFlowConfig knobs; merged into
                       engine_kwargs.additional_config.tokenflow
  env                  extra env vars for replicas and their engine processes
                       (on cpu: LD_PRELOAD of tcmalloc when installed)
  deployment_config    extra Ray Serve options for the engine deployment
                       (e.g. request_router_config, max_ongoing_requests)
  experimental_configs Ray Serve LLM extras (e.g. stream_batching_interval_ms)
  router               slack-aware request routing (actors/ranking.py RouterSettings):
                       enabled, push_interval_s, stale_after_s, refresh_interval_s,
                       horizon_s, capacity_tps, reader_rate, pending_ttl_s.
                       reader_rate defaults to tokenflow.default_rate. A
                       request_router_config in deployment_config wins over it.
  kv_pool              node host-KV pool actors (actors/kv_pool.py KVPoolSettings):
                       enabled, offload, size_bytes (per node; default
                       ram_fraction of the node's RAM), ram_fraction (0.2),
                       engines_per_node (slots), shared_memory (true: the
                       actor owns the pool as one shm file), shm_dir,
                       report_interval_s, engine_ttl_s
  admission            the ingress's front door (deployments/guard.py AdmissionSettings):
                       max_ongoing_requests (POSTs to /v1/ in flight per ingress
                       replica; beyond: 429 + Retry-After), retry_after_s,
                       max_body_bytes (larger: 413), max_n (larger n: 400), max_resends
                       (re-sends of a request whose engine died before its first token). API keys come only from the
                       env (TOKENFLOW_API_KEYS / TOKENFLOW_API_KEYS_FILE).

The HTTP ingress serves the OpenAI API plus GET /health and
GET /v1/tokenflow/engines (each engine's state as the router sees it).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

from tokenflow.config import TokenFlowConfig

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULTS = {
    "model_id": "tiny-llama",
    "model_path": "models/tiny-llama",
    "accelerator": "cpu",
    "accelerator_type": None,
    "num_replicas": 1,
    "autoscaling_config": None,
    "ingress_replicas": 1,
    "replica_num_cpus": None,
    "ingress_num_cpus": None,
    "placement_group_config": None,
    "engine_kwargs": {},
    "tokenflow": None,
    "env": {},
    "deployment_config": {},
    "experimental_configs": {},
    "router": None,
    "kv_pool": None,
    "admission": None,
}

ROUTER_CLASS = "deployments.router:TokenFlowRequestRouter"

# Per-accelerator defaults. On CPU everything but the engine itself asks for
# 0 CPUs: Ray's defaults (1 CPU per replica actor on top of its engine's
# bundle, 1 more for the ingress) leave a second replica pending forever on a
# 2-core machine, with no error. VLLM_CPU_OMP_THREADS_BIND=nobind stops two
# engines from pinning their OpenMP threads onto the same cores.
# VLLM_CPU_KVCACHE_SPACE is deliberately not set: when present it overrides
# engine_kwargs.kv_cache_memory_bytes (and only in whole GiB).
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
    "gpu": {"replica_num_cpus": None, "ingress_num_cpus": None,
            "placement_group_config": None, "env": {}},
}


def tcmalloc() -> str | None:
    """tcmalloc's library name if installed (`make install` tries to), for
    LD_PRELOAD in the engines on CPU. vLLM's CPU backend asks for it; here it
    is what keeps the engines' memory flat: with glibc's malloc their worker
    processes grew 10-14% over a 2,000-request soak, with tcmalloc under 5%
    (docs/RELIABILITY.md). Args `env: {LD_PRELOAD: ""}` turn it off."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def resolve_args(args: dict | None) -> dict:
    """Fill defaults, reject unknown keys, validate the tokenflow block."""
    args = dict(args or {})
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown app args: {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    accel = args.get("accelerator", DEFAULTS["accelerator"])
    if accel not in ACCELERATOR_DEFAULTS:
        raise ValueError(f"accelerator must be one of {sorted(ACCELERATOR_DEFAULTS)}, got {accel!r}")
    out = copy.deepcopy(DEFAULTS)
    for key, value in ACCELERATOR_DEFAULTS[accel].items():
        out[key] = copy.deepcopy(value)
    if accel == "cpu" and (lib := tcmalloc()):
        out["env"]["LD_PRELOAD"] = lib
    for key, value in args.items():
        if key == "env":  # extend, not replace, the accelerator's env vars
            out["env"].update(value or {})
        elif key == "engine_kwargs":  # given: passed through as is, no defaults mixed in
            out[key] = dict(value or {})
        elif value is not None:
            out[key] = value
    # `serve run deployments.app:build_app num_replicas=2` passes strings.
    for key, kind in (("num_replicas", int), ("ingress_replicas", int),
                      ("replica_num_cpus", float), ("ingress_num_cpus", float)):
        if out[key] is not None:
            out[key] = kind(out[key])
    out["engine_kwargs"] = merge_tokenflow_config(out["engine_kwargs"], out["tokenflow"])
    out["router"], out["kv_pool"] = cluster_settings(out)
    from deployments.guard import AdmissionSettings
    out["admission"] = AdmissionSettings.from_dict(out["admission"]).to_dict()
    return out


def cluster_settings(a: dict) -> tuple[dict, dict]:
    """Validated `router` and `kv_pool` blocks, defaults filled in."""
    from actors.kv_pool import KVPoolSettings
    from actors.ranking import RouterSettings

    router = RouterSettings.from_dict(a["router"])
    if router.reader_rate is None:
        # A newcomer is assumed to read at the rate the scheduler assumes.
        tokenflow = (a["engine_kwargs"].get("additional_config") or {}).get("tokenflow")
        router.reader_rate = TokenFlowConfig.from_dict(tokenflow).default_rate
    return router.to_dict(), KVPoolSettings.from_dict(a["kv_pool"]).to_dict()


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


def resolve_model_path(path: str) -> str:
    # Replicas and the app builder do not necessarily run in the directory
    # `serve run` was started from, so make relative paths absolute here.
    p = Path(path).expanduser()
    if not p.is_absolute() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    return str(p.resolve()) if p.exists() else path  # else: maybe a HF model id


def build_llm_config(args: dict | None):
    from ray.serve.llm import LLMConfig

    a = resolve_args(args)
    deployment_config = copy.deepcopy(a["deployment_config"])
    if a["autoscaling_config"] is not None:
        deployment_config["autoscaling_config"] = a["autoscaling_config"]
    else:
        deployment_config["num_replicas"] = a["num_replicas"]
    if a["replica_num_cpus"] is not None:
        deployment_config.setdefault("ray_actor_options", {})["num_cpus"] = a["replica_num_cpus"]
    if a["router"]["enabled"] and "request_router_config" not in deployment_config:
        deployment_config["request_router_config"] = {
            "request_router_class": ROUTER_CLASS, "request_router_kwargs": a["router"]}

    kwargs = dict(
        model_loading_config={"model_id": a["model_id"],
                              "model_source": resolve_model_path(a["model_path"])},
        engine_kwargs=a["engine_kwargs"],
        accelerator_config={"kind": a["accelerator"]},
        deployment_config=deployment_config,
        experimental_configs=a["experimental_configs"],
        # Dotted path, so the replica process imports it itself.
        server_cls="deployments.server:TokenFlowLLMServer",
    )
    if a["placement_group_config"] is not None:
        kwargs["placement_group_config"] = a["placement_group_config"]
    if a["accelerator_type"] is not None:
        kwargs["accelerator_type"] = a["accelerator_type"]
    if a["env"]:
        kwargs["runtime_env"] = {"env_vars": {k: str(v) for k, v in a["env"].items()}}
    return LLMConfig(**kwargs), a


def build_app(args: dict | None = None):
    """Application builder for `serve run deployments.app:build_app` / YAML.

    The same graph as ray.serve.llm's build_openai_app (OpenAI ingress ->
    engine deployment), built here so that the ingress gets TokenFlow's extra
    routes and the engines get the router and kv_pool settings."""
    if os.environ.get("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", "0") == "1":
        # That mode serves vLLM's own ASGI app from the replica and bypasses
        # TokenFlowLLMServer.chat/completions, so consumption_rate would be lost.
        raise RuntimeError("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 is not supported by TokenFlow")
    from ray import serve
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import init as init_fastapi, make_fastapi_ingress
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment

    from deployments import guard
    from deployments.router import TOKENFLOW_ENDPOINTS, TokenFlowIngress

    llm_config, a = build_llm_config(args)
    if a["kv_pool"]["enabled"]:
        create_node_kv_pools(llm_config, a["kv_pool"])
    engines = build_llm_deployment(
        llm_config, bind_kwargs={"tokenflow_cluster": {"router": a["router"], "kv_pool": a["kv_pool"]}})

    ingress_config = {"num_replicas": a["ingress_replicas"]}
    if a["ingress_num_cpus"] is not None:
        ingress_config["ray_actor_options"] = {"num_cpus": a["ingress_num_cpus"]}
    options = maybe_apply_llm_deployment_config_defaults(
        TokenFlowIngress.get_deployment_options([llm_config]), ingress_config)
    fastapi_app = init_fastapi()
    guard.install(fastapi_app, a["admission"])  # API keys, admission bound, body limit
    ingress_cls = make_fastapi_ingress(TokenFlowIngress, endpoint_map=TOKENFLOW_ENDPOINTS, app=fastapi_app)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments={llm_config.model_id: engines},
        model_cards={llm_config.model_id: to_model_metadata(llm_config.model_id, llm_config)},
        lora_paths=({llm_config.model_id: llm_config.lora_config.dynamic_lora_loading_path}
                    if llm_config.lora_config is not None else {}),
        tokenflow_router=a["router"],
        max_resends=a["admission"]["max_resends"],
    )


def create_node_kv_pools(llm_config, kv_pool: dict) -> list[str]:
    """One KV pool actor on every alive node that can hold an engine; returns
    their node ids. Without a Ray connection yet (`serve run module:builder`
    builds before connecting) each engine creates its node's pool instead."""
    import ray

    from actors.kv_pool import KVPoolSettings, ensure_node_pools
    from deployments.server import TokenFlowLLMServer

    if not ray.is_initialized():
        return []
    bundles = TokenFlowLLMServer.get_deployment_options(llm_config).get("placement_group_bundles") or [{}]
    return sorted(ensure_node_pools(KVPoolSettings.from_dict(kv_pool), bundles[0]))


def wait_ready(app_name: str = "default", timeout: float = 600.0, poll_s: float = 1.0) -> float:
    """Block until Serve reports `app_name` RUNNING; return seconds waited.

    Readiness is the app status, not HTTP: /v1/models answers well before the
    engines can generate. Raises RuntimeError if deployment failed and
    TimeoutError after `timeout` seconds."""
    import ray
    from ray import serve

    start = time.monotonic()
    last = None
    while True:
        if not ray.is_initialized():
            # `serve run` may still be importing vLLM before it starts Ray.
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"no Ray cluster to connect to after {timeout:.0f}s") from None
                time.sleep(poll_s)
                continue
        app = serve.status().applications.get(app_name)
        last = app.status if app is not None else None
        if last == "RUNNING":
            return time.monotonic() - start
        if last == "DEPLOY_FAILED":  # UNHEALTHY may recover: keep waiting
            raise RuntimeError(f"app {app_name!r} is {last}: {app.message}")
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"app {app_name!r} not RUNNING after {timeout:.0f}s (status {last})")
        time.sleep(poll_s)


if __name__ == "__main__":
    # python -m deployments.app [APP_NAME] [TIMEOUT_S]: wait, then print READY.
    name = sys.argv[1] if len(sys.argv) > 1 else "default"
    waited = wait_ready(name, float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
    print(f"READY {name} after {waited:.1f}s", flush=True)
