"""The app's args: one schema (tokenflow/serve/settings.py), published as
docs/config-schema.json; what a user gets back for a good and a bad config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tokenflow.serve.app import resolve_args
from tokenflow.serve.settings import AppSettings, json_schema

ROOT = Path(__file__).resolve().parent.parent


def test_published_schema_is_the_generated_one():
    out = subprocess.run([sys.executable, "-m", "tokenflow.tools.cli", "config-schema"],
                         capture_output=True, text=True, check=True).stdout
    assert out == json_schema() == (ROOT / "docs" / "config-schema.json").read_text()
    schema = json.loads(out)
    assert schema["additionalProperties"] is False
    # every field of every block says what it is
    for block in [schema, *schema["$defs"].values()]:
        for name, prop in block["properties"].items():
            assert prop.get("description"), name


def test_shipped_configs_validate():
    for name in ("local.yaml", "gpu.yaml"):
        args = yaml.safe_load((ROOT / "configs" / name).read_text())["applications"][0]["args"]
        AppSettings.from_dict(args)


@pytest.mark.parametrize("args, message", [
    ({"num_replica": 2}, "unknown app args keys: ['num_replica']"),
    ({"tokenflow": {"dtt": 0.1}}, "unknown app args keys: ['tokenflow.dtt']"),
    ({"router": {"push_interval": 0.1}}, "['router.push_interval']"),
    ({"tokenflow": {"dt": 0}}, "tokenflow.dt: Input should be greater than 0"),
    ({"tokenflow": {"policy": "lifo"}}, "tokenflow.policy"),
    ({"tokenflow": {"mu": True}}, "must be a number, not true/false"),
    ({"admission": {"max_n": 2.5}}, "admission.max_n"),
    ({"kv_pool": {"ram_fraction": 1.5}}, "kv_pool.ram_fraction"),
    ({"accelerator": "tpu"}, "accelerator"),
    ({"tokenflow": {"dt": 0.1}, "engine_kwargs": {"additional_config": {"tokenflow": {"dt": 0.2}}}}, "keep one"),
])
def test_bad_args_are_refused_with_the_key_named(args, message):
    with pytest.raises(ValueError) as e:
        resolve_args(args)
    assert message in str(e.value)


def test_defaults_and_command_line_strings():
    a = resolve_args({"num_replicas": "2", "replica_num_cpus": "0.5", "env": {"X": 1}, "router": None})
    assert a["num_replicas"] == 2 and a["replica_num_cpus"] == 0.5  # `serve run ... num_replicas=2` gives strings
    assert a["env"]["X"] == 1 and a["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # extends the cpu defaults
    assert a["engine_kwargs"]["dtype"] == "float32"  # cpu defaults when no engine_kwargs are given
    assert a["router"]["reader_rate"] == 40.0  # null: the default block, reading at tokenflow's default rate
    a = resolve_args({"tokenflow": {"default_rate": 12}, "engine_kwargs": {"max_model_len": 512}})
    assert a["engine_kwargs"] == {"max_model_len": 512, "additional_config": {"tokenflow": {"default_rate": 12.0}}}
    assert a["router"]["reader_rate"] == 12.0
    gpu = resolve_args({"accelerator": "gpu"})
    assert gpu["replica_num_cpus"] is None and gpu["engine_kwargs"] == {}  # Ray Serve LLM's own defaults


@pytest.mark.parametrize("model_path, skipped", [
    ("models/tiny-llama", True),              # a directory here: nothing to fetch
    ("meta-llama/Llama-3.2-1B", False),       # a hub id: Serve LLM's step as it is
    ("s3://bucket/models/tiny-llama", False),  # a mirror: the step downloads it
])
def test_the_node_download_step_is_skipped_only_for_a_local_model(model_path, skipped):
    """The engines' LLMConfig carries TokenFlow's callback, and the callback
    turns off Serve LLM's per-node download task only where it would fetch
    nothing (the context it reads is the one Serve LLM's engine start reads)."""
    import asyncio

    from tokenflow.serve.app import build_llm_config

    args = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]["args"]
    llm_config, _ = build_llm_config({**args, "model_path": model_path})
    callback = llm_config.get_or_create_callback()
    assert type(callback).__name__ == "LocalModelCallback"
    asyncio.run(callback.run_callback("on_before_node_init"))
    assert callback.ctx.run_init_node is (not skipped)


def test_a_replaced_ingress_relays_its_streams_as_long_as_a_request_may_run():
    """Serve gives a replica it stops `graceful_shutdown_timeout_s` (20 s by
    default) to finish its requests; the ingress, which relays every stream,
    gets as long as the guard lets a request run (the live redeploy is in
    tests/test_failover.py)."""
    from tokenflow.serve.app import DRAIN_UNBOUNDED_S, ingress_deployment_config

    args = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]["args"]
    assert ingress_deployment_config(resolve_args(args))["graceful_shutdown_timeout_s"] == 3600
    unbounded = resolve_args({**args, "admission": {**args["admission"], "request_timeout_s": None}})
    assert ingress_deployment_config(unbounded)["graceful_shutdown_timeout_s"] == DRAIN_UNBOUNDED_S


def test_a_stopped_engine_replica_finishes_its_whole_requests_unless_the_config_says_otherwise():
    """Streams leave a replica Serve stops at their next chunk; a whole
    request finishes there, so the engines get as long as a request may run
    instead of Serve's 20 s, and a `deployment_config` value still wins."""
    from tokenflow.serve.app import DRAIN_UNBOUNDED_S, build_llm_config

    args = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]["args"]
    assert build_llm_config(args)[0].deployment_config["graceful_shutdown_timeout_s"] == 3600
    unbounded = {**args, "admission": {**args["admission"], "request_timeout_s": None}}
    assert build_llm_config(unbounded)[0].deployment_config["graceful_shutdown_timeout_s"] == DRAIN_UNBOUNDED_S
    own = {**args, "deployment_config": {**args.get("deployment_config", {}), "graceful_shutdown_timeout_s": 45}}
    assert build_llm_config(own)[0].deployment_config["graceful_shutdown_timeout_s"] == 45
