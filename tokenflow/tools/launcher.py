"""Run `serve run CONFIG` in the foreground, say when it is really ready, and
stop it cleanly on Ctrl-C.

Readiness is a real completion answered by an engine, not `/v1/models`
(which answers well before the engines are up). `serve run` gets SIGINT back
at its default, since a launcher started from a non-interactive shell
inherits it ignored and could then never stop gracefully.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tokenflow.serve.guard import KeyFileError, load_api_keys


def app_settings(config: str) -> dict:
    """Model name, host and port that a `serve run` YAML will serve."""
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"no such config: {config}")
    doc = yaml.safe_load(path.read_text()) or {}
    http = doc.get("http_options") or {}
    apps = doc.get("applications") or [{}]
    args = apps[0].get("args") or {}
    return {
        "host": http.get("host", "127.0.0.1"),
        "port": int(http.get("port", 8000)),
        "model": args.get("model_id", "tiny-llama"),
        "route": apps[0].get("route_prefix", "/"),
    }


def app_args_arg(command: str, text: str) -> dict | None:
    """A bench's `--app-args` as a dict, or None after printing why it is
    not one (the caller exits 2)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        print(f"tokenflow {command}: error: --app-args is not JSON: {e}", file=sys.stderr)
        return None
    if not isinstance(value, dict):
        print(f"tokenflow {command}: error: --app-args must be a JSON object", file=sys.stderr)
        return None
    return value


def api_key_from_env() -> str | None:
    """A key the app accepts when API keys are on (read from the same
    environment the app reads them from), so our own requests pass its guard."""
    try:
        keys = load_api_keys()
    except KeyFileError:
        return None  # the app fails closed too; probes then time out with its 401s
    return min(keys) if keys else None


def probe(base_url: str, model: str, timeout: float = 30.0, api_key: str | None = None) -> bool:
    """True when a one-token completion succeeds."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base_url}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_until_ready(base_url: str, model: str, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    key = api_key_from_env()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if probe(base_url, model, api_key=key):
            return True
        time.sleep(2.0)
    return False


def _child_setup(niceness: int):
    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if niceness:
            os.nice(niceness)  # Ray's raylet and workers inherit it
            # With the kernel's autogroups (one per session; the child has a
            # new one), CPU is shared between sessions first and a process's
            # nice only counts inside its own: lower the whole session too.
            try:
                with open("/proc/self/autogroup", "w") as f:
                    f.write(str(niceness))
            except OSError:
                pass  # no autogroups here: the plain nice is what counts
    return setup


def start(config: str, log=None, niceness: int = 0) -> subprocess.Popen:
    """Start `serve run CONFIG` in its own process group, `niceness` below
    the caller's CPU priority (a bench's client must not starve for CPU
    behind the app it measures)."""
    serve_bin = shutil.which("serve", path=os.path.dirname(sys.executable)) or shutil.which("serve")
    if serve_bin is None:
        raise FileNotFoundError("the `serve` command (ray[serve]) is not installed")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return subprocess.Popen(
        [serve_bin, "run", config],
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        start_new_session=True,
        preexec_fn=_child_setup(niceness),
        env=env,
    )


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGINT the whole process group, then SIGKILL it after `grace` s.
    (`serve run` shuts the app and Ray down on SIGINT; Locust writes its reports.)"""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


SHM = "/dev/shm"
# Python multiprocessing's shared memory and semaphores: vLLM's engine
# processes, killed with a Serve app rather than shut down, leave them here.
SHM_LEFTOVERS = ("psm_", "sem.mp-")


def shm_names() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def remove_shm_leftovers(before: set[str], settle: float = 0.0) -> None:
    """Remove the multiprocessing files that appeared in /dev/shm since
    `before` and that no live process maps; wait up to `settle` s for the
    processes that still map them to go."""
    deadline = time.monotonic() + settle
    while True:
        new = [n for n in shm_names() - before if n.startswith(SHM_LEFTOVERS)]
        mapped = _mapped_paths()
        for name in new:
            if name not in mapped:
                try:
                    os.unlink(os.path.join(SHM, name))
                except FileNotFoundError:
                    pass
        if not any(n in mapped for n in new) or time.monotonic() >= deadline:
            return
        time.sleep(0.5)


def _mapped_paths() -> str:
    """Every path some live process maps, as one string to search."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    out.append(f.read())
            except OSError:
                continue
    return "\n".join(out)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt, so the caller stops what
    it started, even when this process was started with SIGINT ignored (a
    background job of a script)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def serve(config: str, host: str = "127.0.0.1", port: int = 8000, timeout: float = 600.0) -> int:
    stop_on_signals()
    settings = app_settings(config)
    base = f"http://{settings['host']}:{settings['port']}"
    shm_before = shm_names()
    proc = start(config)
    try:
        if not wait_until_ready(base, settings["model"], timeout, proc):
            print(f"tokenflow: error: the app did not become ready within {timeout:.0f} s", file=sys.stderr)
            stop(proc)
            return 1
        model = settings["model"]
        curl = (
            f"curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{model}\", \"stream\": true, \"consumption_rate\": 20, "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Tell me a story\"}}]}}'"
        )
        print(f"\nTokenFlow is ready: {base}/v1  (model: {model})\nTry:\n  {curl}\n", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        stop(proc)
        return 0
    finally:
        remove_shm_leftovers(shm_before, settle=15.0)
