"""`tokenflow tiny-model`: no download, deterministic, loads in vLLM."""

from __future__ import annotations

import gc
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "tokenflow.tools.cli"]


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_same_seed_same_files_and_rerun_is_safe(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        r = subprocess.run(CLI + ["tiny-model", str(d), "--seed", "3"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert digest(a) == digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(digest(a))
    before = digest(a)
    r = subprocess.run(CLI + ["tiny-model", str(a), "--seed", "3"], capture_output=True, text=True)
    assert r.returncode == 0 and digest(a) == before  # re-run into an existing dir
    r = subprocess.run(CLI + ["tiny-model", str(a), "--seed", "4", "--force"], capture_output=True, text=True)
    assert r.returncode == 0 and digest(a)["model.safetensors"] != before["model.safetensors"]


def test_cli_error_is_clear(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = subprocess.run(CLI + ["tiny-model", str(blocker / "model")], capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.startswith("tokenflow: error:")
    r = subprocess.run(CLI + ["bench", "--requests", "-3"], capture_output=True, text=True)
    assert r.returncode == 2 and "positive" in r.stderr


@pytest.mark.slow
def test_tiny_model_generates_in_vllm(tmp_path):
    from vllm import SamplingParams

    from tests.engines import make_llm
    from tokenflow.tools.tiny_model import make_tiny_model

    d = make_tiny_model(tmp_path / "m", seed=1)
    llm = make_llm(model=str(d))
    out = llm.generate(["the reader"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].text.strip()
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 4
    del llm
    gc.collect()
