"""Every name TokenFlow takes from Ray's private modules, in one place.

Each has no public counterpart in Ray 2.60; on a Ray upgrade, this file is
the one to re-check. Public names (`ray.serve.llm`, `ray.serve.llm.ingress`,
`ray.serve.llm.openai_api_models`, `ray.serve.request_router`) are imported
where they are used.
"""

# Serve LLM's hook around its per-node model download, which lets a
# callback skip that step (tokenflow/serve/node_init.py).
from ray.llm._internal.common.callbacks.base import CallbackBase  # noqa: F401

# The ingress's own FastAPI app (`init`, with Ray's exception middleware) and
# its route table: TokenFlow adds routes and its guard to that app, which
# `build_openai_app` builds out of reach (`init_fastapi`, `DEFAULT_ENDPOINTS`
# below). What `build_openai_app` does with the ingress's options and model
# cards (this, and `to_model_metadata` below), repeated by
# tokenflow/serve/app.py, which builds the same graph itself. `ErrorInfo`
# below: the error body of an ErrorResponse (the public one needs it).
from ray.llm._internal.common.dict_utils import (
    maybe_apply_llm_deployment_config_defaults,  # noqa: F401
)

# Serve's default request router: the slack router extends it, to keep its
# fallback (power of two choices) and its replica queue-length cache.
from ray.serve._private.request_router.pow_2_router import (
    PowerOfTwoChoicesRequestRouter,  # noqa: F401
)

# Those of Serve LLM's modules import vLLM (about 9 s of a core), so their
# names are imported on first use (`__getattr__` below): the request router
# needs none of them, and Serve's controller imports it to validate every
# config override (a `serve deploy` that scales the engines), which then
# waited for vLLM's import.
_HEAVY = {
    "ErrorInfo": ("ray.llm._internal.serve.core.configs.openai_api_models", "ErrorInfo"),
    "to_model_metadata": ("ray.llm._internal.serve.core.configs.openai_api_models", "to_model_metadata"),
    # What /v1/models lists for a model: `tokenflow bench-ingress` writes one
    # for its stand-in engine, which has no LLMConfig to derive it from.
    "ModelCard": ("ray.llm._internal.serve.core.configs.openai_api_models", "ModelCard"),
    "DEFAULT_ENDPOINTS": ("ray.llm._internal.serve.core.ingress.ingress", "DEFAULT_ENDPOINTS"),
    "init_fastapi": ("ray.llm._internal.serve.core.ingress.ingress", "init"),
}


def __getattr__(name: str):
    if name not in _HEAVY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _HEAVY[name]
    return getattr(importlib.import_module(module), attr)



def replica_stopping():
    """A cheap read of whether Serve has begun to stop the replica this code
    runs in (its graceful shutdown sets `Replica._shutting_down` before it
    drains the replica's requests; the user callable hears of it only after,
    in `__del__`). The replica is the actor object of this worker. None
    outside a Serve replica."""
    import ray

    worker = ray._private.worker.global_worker
    actor = getattr(worker, "actors", {}).get(worker.actor_id)
    impl = getattr(actor, "_replica_impl", None)
    if impl is None or not hasattr(impl, "_shutting_down"):
        return None
    return lambda: impl._shutting_down
