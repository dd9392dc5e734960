"""The OpenAI API of the running app, through the real `openai` client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def _stream_times(stream, text_of):
    times, parts, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        piece = text_of(chunk.choices[0])
        if piece:
            times.append(time.monotonic())
            parts.append(piece)
        finish = chunk.choices[0].finish_reason or finish
    return times, parts, finish, usage


def test_models_lists_the_model(client, serve_app):
    ids = [m.id for m in client.models.list().data]
    assert serve_app["model"] in ids


def test_streaming_chat(client, serve_app):
    stream = client.chat.completions.create(
        model=serve_app["model"], stream=True, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Tell me about the river"}],
        stream_options={"include_usage": True}, extra_body={"consumption_rate": 20},
    )
    times, parts, finish, usage = _stream_times(stream, lambda c: c.delta.content)
    assert len(parts) >= 8, "tokens must arrive as several chunks"
    assert len(set(times)) >= 4, "chunks must arrive at distinct times"
    assert finish == "length"
    assert usage.completion_tokens == 40
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + 40


def test_streaming_text_completion(client, serve_app):
    stream = client.completions.create(
        model=serve_app["model"], prompt="The reader and the stream", stream=True, max_tokens=48,
        temperature=0, stream_options={"include_usage": True},
    )
    times, parts, finish, usage = _stream_times(stream, lambda c: c.text)
    assert len(parts) >= 8 and len(set(times)) >= 4
    assert finish == "length"
    assert usage.completion_tokens == 48


def test_non_streaming_matches_streaming(client, serve_app):
    kw = dict(model=serve_app["model"], prompt="morning light on the mountain", max_tokens=32, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.usage.completion_tokens == 32 and whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole.choices[0].text


def _post(serve_app, path, body, raw=False):
    content = body if raw else json.dumps(body)
    return httpx.post(serve_app["base_url"] + path, content=content,
                      headers={"Content-Type": "application/json"}, timeout=60)


BAD = [
    ("unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ("negative max_tokens", {"model": "MODEL", "prompt": "hi", "max_tokens": -5}),
    ("prompt longer than context", {"model": "MODEL", "prompt": "river " * 5000, "max_tokens": 4}),
    ("negative rate", {"model": "MODEL", "prompt": "hi", "max_tokens": 4, "consumption_rate": -1}),
    ("zero rate", {"model": "MODEL", "prompt": "hi", "max_tokens": 4, "consumption_rate": 0}),
    ("string rate", {"model": "MODEL", "prompt": "hi", "max_tokens": 4, "consumption_rate": "fast"}),
    ("huge rate", {"model": "MODEL", "prompt": "hi", "max_tokens": 4, "consumption_rate": 1e12}),
    ("bad xargs rate", {"model": "MODEL", "prompt": "hi", "max_tokens": 4, "vllm_xargs": {"consumption_rate": -3}}),
]


@pytest.mark.parametrize("name,body", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_json_and_server_keeps_serving(client, serve_app, name, body):
    body = {k: (serve_app["model"] if v == "MODEL" else v) for k, v in body.items()}
    r = _post(serve_app, "/v1/completions", body)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
    err = r.json()
    assert "error" in err or "message" in err or "detail" in err, err
    ok = client.completions.create(model=serve_app["model"], prompt="still there?", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_malformed_json_gets_4xx(client, serve_app):
    r = _post(serve_app, "/v1/chat/completions", '{"model": "tiny-llama", "messages": [', raw=True)
    assert 400 <= r.status_code < 500
    r.json()  # a JSON body, not an HTML page
    ok = client.chat.completions.create(model=serve_app["model"], max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.completion_tokens == 4


def test_valid_rate_is_accepted_both_ways(client, serve_app):
    for extra in ({"consumption_rate": 12.5}, {"vllm_xargs": {"consumption_rate": 8}}):
        r = client.completions.create(model=serve_app["model"], prompt="rate", max_tokens=4, extra_body=extra)
        assert r.usage.completion_tokens == 4


def test_openai_client_raises_on_bad_rate(client, serve_app):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=serve_app["model"], max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"consumption_rate": "NaN"})
    assert "consumption_rate" in str(e.value)


def test_engines_share_the_node_host_pool(client, serve_app):
    """local.yaml: offload on, 256 MiB per node, two engines: each engine's
    host tier is half, and together they stay within the node's pool."""
    import yaml

    from tests.conftest import LOCAL_CONFIG
    from tokenflow.kv_offload.host_shm import mapped_ranges

    args = yaml.safe_load(open(LOCAL_CONFIG))["applications"][0]["args"]
    node_pool = args["kv_pool"]["size_bytes"]
    kv_bytes = args["engine_kwargs"]["kv_cache_memory_bytes"]
    view = httpx.get(serve_app["base_url"] + "/v1/tokenflow/engines", timeout=30).json()
    engines = view["engines"]
    assert len(engines) == 2
    # The node's pool actor owns the memory: one shared file of two slots,
    # one per engine, each mapped by that engine's worker process only.
    (pool,) = view["kv_pools"].values()
    shm = pool["shared_memory"]
    assert shm["bytes"] == 2 * shm["slot_bytes"] <= node_pool
    assert sorted(h["engine_id"] for h in shm["slots"]) == sorted(e["engine_id"] for e in engines)
    mapped = mapped_ranges(shm["inode"])
    slots_mapped = sorted((lo // shm["slot_bytes"], pid) for pid, rs in mapped.items() for lo, _ in rs)
    assert [s for s, _ in slots_mapped] == [0, 1], mapped
    assert slots_mapped[0][1] != slots_mapped[1][1], "two engines, two processes"
    tiers = []
    for e in engines:
        sched = e["scheduler"]
        assert sched["policy"] == "tokenflow", "the TokenFlow scheduler runs inside each engine"
        bytes_per_block = kv_bytes // sched["kv_total_blocks"]
        tiers.append(sched["host_pool_blocks"] * bytes_per_block)
    assert all(t > 0 for t in tiers)
    assert tiers[0] == tiers[1] and sum(tiers) <= node_pool


def test_a_continuation_runs_from_its_last_whole_character(client, serve_app):
    """A continued stream's request (continuation.py: its vllm_xargs say how
    many of the prompt's last ids are the answer's) whose prompt ends inside
    a character: the engine replica cuts those ids off, to be generated
    again, and the prompt ids it reports show the cut. Without the cut
    vLLM's detokenizer starts the text with the whole prompt's."""
    from transformers import AutoTokenizer

    from tests.engines import ensure_model
    from tokenflow.core.config import SENT_KEY

    tok = AutoTokenizer.from_pretrained(ensure_model())
    chat = tok.encode("<|user|>\nthe quick river\n<|assistant|>\n")
    answer = tok.encode(" 416") + tok.encode("\u00e9")[:1]  # ends on the first byte of a character

    def run(xargs):
        stream = client.completions.create(model=serve_app["model"], prompt=chat + answer, max_tokens=8,
                                           temperature=0, stream=True,
                                           extra_body={"return_token_ids": True, "vllm_xargs": xargs})
        choices = [c.choices[0] for c in stream if c.choices]
        ids = [t for ch in choices for t in ch.model_extra["token_ids"] or []]
        return choices[0].model_extra["prompt_token_ids"], "".join(ch.text for ch in choices), ids

    prompt, text, ids = run({SENT_KEY: len(answer)})
    assert prompt == chat + answer[:-1] and len(ids) == 9, (prompt, ids)
    assert "quick river" not in text, text
    prompt, text, _ = run({})  # not a continuation: left as it is
    assert prompt == chat + answer
    assert "quick river" in text, ("vLLM no longer starts such a prompt's text with the prompt; "
                                   "the cut (end_on_whole_character) may be dropped", text)
