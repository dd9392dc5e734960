"""Shared fixtures: one real Ray Serve app for the whole session.

Starting two vLLM engines behind Serve takes a minute or two on 2 cores, so
every HTTP-level test shares this one app (started the way users start it,
`serve run`) and stops it by process group. Its config is configs/local.yaml
with the two switches only tests need turned on (TEST_CONFIG, written on
import: `python -m tests.conftest` writes it for an app of your own)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from tests.engines import ROOT, ensure_model
from tokenflow.tools import launcher

LOCAL_CONFIG = str(ROOT / "configs" / "local.yaml")
TEST_CONFIG = str(ROOT / "build" / "test-app.yaml")


def write_test_config() -> None:
    """local.yaml with rebalancing and engine pinning on: the rebalance
    tests pin a burst to one engine and watch it move; both are off in
    local.yaml (`make serve`), as by default."""
    import yaml

    with open(LOCAL_CONFIG) as f:
        doc = yaml.safe_load(f)
    args = doc["applications"][0]["args"]
    args["router"]["rebalance"] = True
    args["admission"]["engine_pinning"] = True
    Path(TEST_CONFIG).parent.mkdir(exist_ok=True)
    text = "# Written by tests/conftest.py from configs/local.yaml; do not edit.\n" + yaml.safe_dump(doc, sort_keys=False)
    if not Path(TEST_CONFIG).is_file() or Path(TEST_CONFIG).read_text() != text:
        Path(TEST_CONFIG).write_text(text)


write_test_config()


@pytest.fixture(scope="session", autouse=True)
def no_shm_leftovers():
    """Remove what vLLM's killed engine processes left in /dev/shm during
    this session (and no live process maps any more)."""
    before = launcher.shm_names()
    yield
    launcher.remove_shm_leftovers(before)


@pytest.fixture(scope="session")
def serve_app():
    ensure_model()
    settings = launcher.app_settings(TEST_CONFIG)
    base = f"http://{settings['host']}:{settings['port']}"
    if os.environ.get("TOKENFLOW_TEST_REUSE_APP"):
        # Developer loop: test an app already started with
        # `tokenflow serve build/test-app.yaml` instead of starting one per session.
        yield {"base_url": base, "model": settings["model"], "log": None}
        return
    with socket.socket() as sock:
        if sock.connect_ex((settings["host"], settings["port"])) == 0:
            # `serve run` would deploy into that app's Ray cluster, and the
            # tests would run against whatever code it was started with.
            pytest.fail(f"something already listens at {base}: stop it, "
                        "or set TOKENFLOW_TEST_REUSE_APP=1 to test an app started with "
                        "`tokenflow serve build/test-app.yaml`")
    log_path = Path(tempfile.gettempdir()) / f"tokenflow-serve-{os.getpid()}.log"
    with open(log_path, "wb") as log:
        proc = launcher.start(TEST_CONFIG, log=log)
        try:
            if not launcher.wait_until_ready(base, settings["model"], timeout=600, proc=proc):
                tail = log_path.read_text(errors="replace")[-4000:]
                pytest.fail(f"serve app not ready; log tail:\n{tail}")
            yield {"base_url": base, "model": settings["model"], "log": log_path}
        finally:
            launcher.stop(proc)


@pytest.fixture(scope="session")
def client(serve_app):
    from openai import OpenAI

    return OpenAI(base_url=serve_app["base_url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
