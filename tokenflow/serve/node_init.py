"""Skip Serve LLM's per-node download step when there is nothing to download.

Before it starts an engine, Ray Serve LLM runs one task on each node of the
engine's placement group to fetch the model from a cloud mirror. When no
mirror is configured and the model is a directory on the node, that task
fetches nothing and returns the path it was given, yet it is a fresh Ray
worker that imports torch and Serve LLM first: about 10 s of a core on the
engine's critical path, on every engine start, restarts included
(docs/BENCHMARKS.md, "Engine start"). Any other model source keeps Serve
LLM's step as it is."""

import os

from tokenflow.serve.ray_private import CallbackBase


def nothing_to_download(llm_config) -> bool:
    engine = llm_config.get_engine_config()
    return engine.mirror_config is None and os.path.isdir(engine.actual_hf_model_id)


class LocalModelCallback(CallbackBase):
    """The `callback_config` TokenFlow's engines run with (tokenflow/serve/app.py)."""

    async def on_before_node_init(self) -> None:
        if nothing_to_download(self.llm_config):
            self.ctx.run_init_node = False
