"""The TokenFlow Ray Serve application: an OpenAI-compatible API on vLLM.

    serve run configs/local.yaml                          # CPU, tiny model
    serve run tokenflow.serve.app:build_app model_path=...  # args as key=value

Built on `ray.serve.llm` (OpenAI ingress -> N x TokenFlowLLMServer replicas,
one vLLM engine each). Every arg is described once, in AppSettings
(settings.py; its JSON schema is docs/config-schema.json); unknown keys are
an error, so a typo never silently falls back to a default.

The HTTP ingress serves the OpenAI API plus GET /health and
GET /v1/tokenflow/engines (each engine's state as the router sees it).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

from tokenflow.serve import settings

REPO_ROOT = Path(__file__).resolve().parents[2]

ROUTER_CLASS = "tokenflow.serve.routing.request_router:TokenFlowRequestRouter"


def tcmalloc() -> str | None:
    """tcmalloc's library name if installed (`make install` tries to), for
    LD_PRELOAD in the engines on CPU. vLLM's CPU backend asks for it; here it
    is what keeps the engines' memory flat: with glibc's malloc their worker
    processes grew 10-14% over a 2,000-request soak, with tcmalloc under 5%
    (docs/RELIABILITY.md). Args `env: {LD_PRELOAD: ""}` turn it off."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def resolve_args(args: dict | None) -> dict:
    """Validated args, defaults filled in (settings.resolve)."""
    return settings.resolve(args, tcmalloc())


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
    # A replica Serve stops (a scale-down, a redeploy) hands its streams over
    # at their next chunk (failover.bounce_if_engine_dead), but a whole
    # request has no chunk to leave at: it finishes there. Serve's default
    # 20 s would kill the replica under a long one (the ingress then re-sends
    # it, its work lost), so unless the config says otherwise the replica
    # waits as long as the guard lets any request run.
    deployment_config.setdefault("graceful_shutdown_timeout_s", drain_s(a))
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
        server_cls="tokenflow.serve.llm_server:TokenFlowLLMServer",
        # Skips the per-node download task where the model is a local directory.
        callback_config={"callback_class": "tokenflow.serve.node_init:LocalModelCallback"},
    )
    if a["placement_group_config"] is not None:
        kwargs["placement_group_config"] = a["placement_group_config"]
    if a["accelerator_type"] is not None:
        kwargs["accelerator_type"] = a["accelerator_type"]
    if a["env"]:
        kwargs["runtime_env"] = {"env_vars": {k: str(v) for k, v in a["env"].items()}}
    return LLMConfig(**kwargs), a


# How long a replaced ingress relays its streams, and a stopped engine
# replica finishes its whole requests, when requests have no time limit
# (admission.request_timeout_s null): a day.
DRAIN_UNBOUNDED_S = 86400.0


def drain_s(a: dict) -> float:
    """How long Serve lets a replica it stops finish its requests: as long
    as the guard lets any request run."""
    return a["admission"]["request_timeout_s"] or DRAIN_UNBOUNDED_S


def ingress_deployment_config(a: dict) -> dict:
    """The ingress deployment's options from the resolved args."""
    from tokenflow.serve import guard

    # An ingress that Serve replaces (a redeploy that changes the args) keeps
    # relaying its streams until they end, for as long as the guard lets any
    # request run, instead of cutting them after Serve's default 20 s; it
    # takes no new requests meanwhile and exits when its last stream ends.
    config = {"num_replicas": a["ingress_replicas"], "graceful_shutdown_timeout_s": drain_s(a)}
    if a["ingress_num_cpus"] is not None:
        config["ray_actor_options"] = {"num_cpus": a["ingress_num_cpus"]}
    # API keys given in the app's `env` guard the ingress, which reads them.
    keys_env = {k: str(v) for k, v in a["env"].items() if k in (guard.KEYS_ENV, guard.KEYS_FILE_ENV)}
    if keys_env:
        config.setdefault("ray_actor_options", {})["runtime_env"] = {"env_vars": keys_env}
    return config


def build_app(args: dict | None = None):
    """Application builder for `serve run tokenflow.serve.app:build_app` / YAML.

    The same graph as ray.serve.llm's build_openai_app (OpenAI ingress ->
    engine deployment), built here so that the ingress gets TokenFlow's extra
    routes and the engines get the router and kv_pool settings."""
    if os.environ.get("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", "0") == "1":
        # That mode serves vLLM's own ASGI app from the replica and bypasses
        # TokenFlowLLMServer.chat/completions, so consumption_rate would be lost.
        raise RuntimeError("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 is not supported by TokenFlow")
    from ray.serve.llm import build_llm_deployment

    from tokenflow.serve.ingress import TokenFlowIngress
    from tokenflow.serve.ray_private import maybe_apply_llm_deployment_config_defaults, to_model_metadata

    llm_config, a = build_llm_config(args)
    if a["kv_pool"]["enabled"]:
        create_node_kv_pools(llm_config, a["kv_pool"])
    engines = build_llm_deployment(
        llm_config, bind_kwargs={"tokenflow_cluster": {"router": a["router"], "kv_pool": a["kv_pool"]}})

    options = maybe_apply_llm_deployment_config_defaults(
        TokenFlowIngress.get_deployment_options([llm_config]), ingress_deployment_config(a))
    return bind_ingress(a, options, {llm_config.model_id: engines},
                        {llm_config.model_id: to_model_metadata(llm_config.model_id, llm_config)},
                        ({llm_config.model_id: llm_config.lora_config.dynamic_lora_loading_path}
                         if llm_config.lora_config is not None else {}))


def bind_ingress(a: dict, options: dict, llm_deployments: dict, model_cards: dict, lora_paths: dict):
    """TokenFlow's ingress (the guard, the OpenAI API, re-sends and
    continuation) as a Serve deployment with `options`, bound to the engine
    deployments: the app's, or `tokenflow bench-ingress`'s stand-ins."""
    from ray import serve
    from ray.serve.llm.ingress import make_fastapi_ingress

    from tokenflow.serve import guard
    from tokenflow.serve.ingress import TOKENFLOW_ENDPOINTS, TokenFlowIngress
    from tokenflow.serve.ray_private import init_fastapi

    fastapi_app = init_fastapi()
    guard.install(fastapi_app, a["admission"])  # API keys, admission bound, body limit
    ingress_cls = make_fastapi_ingress(TokenFlowIngress, endpoint_map=TOKENFLOW_ENDPOINTS, app=fastapi_app)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments=llm_deployments, model_cards=model_cards, lora_paths=lora_paths,
        tokenflow_router=a["router"],
        max_resends=a["admission"]["max_resends"],
        max_continuations=a["admission"]["max_continuations"],
    )


def create_node_kv_pools(llm_config, kv_pool: dict) -> list[str]:
    """One KV pool actor on every alive node that can hold an engine; returns
    their node ids. Without a Ray connection yet (`serve run module:builder`
    builds before connecting) each engine creates its node's pool instead."""
    import ray

    from tokenflow.serve.kv_pool import KVPoolSettings, ensure_node_pools
    from tokenflow.serve.llm_server import TokenFlowLLMServer

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
    # python -m tokenflow.serve.app [APP_NAME] [TIMEOUT_S]: wait, then print READY.
    name = sys.argv[1] if len(sys.argv) > 1 else "default"
    waited = wait_ready(name, float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
    print(f"READY {name} after {waited:.1f}s", flush=True)
