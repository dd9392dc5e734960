"""Stream continuation's bookkeeping (tokenflow/serve/continuation.py), on
chunks made with vLLM's own response classes the way its serving code makes
them; the failover relay that uses it (tokenflow/serve/failover.py) on
scripted streams. The live kills are in tests/test_failover.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from tests.test_failover import scripted
from tests.engines import ensure_model
from tokenflow.core.config import CARRIED_KEY, SENT_KEY, WAITED_KEY, parse_carried
from tokenflow.serve.continuation import Ledger, continuable, end_on_whole_character
from tokenflow.serve.failover import LOST_MESSAGE, STOPPING, EngineLost, relay

PROMPT = [1, 5, 9, 12]


def data(model) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


def completion_chunk(id_, text, ids, prompt=None, finish=None, usage=None, created=100):
    choice = CompletionResponseStreamChoice(index=0, text=text, logprobs=None, finish_reason=finish,
                                            stop_reason=None, prompt_token_ids=prompt, token_ids=ids)
    chunk = CompletionStreamResponse(id=id_, object="text_completion", created=created, model="m", choices=[choice])
    if usage is not None:
        chunk.usage = UsageInfo(prompt_tokens=usage[0], completion_tokens=usage[1], total_tokens=sum(usage))
    return data(chunk)


def usage_chunk(id_, prompt, done, created=100, chat=False):
    cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
    return data(cls(id=id_, created=created, model="m", choices=[],
                    usage=UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)))


def chat_role_chunk(id_, prompt_ids):
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""),
                                                logprobs=None, finish_reason=None)
    return data(ChatCompletionStreamResponse(id=id_, object="chat.completion.chunk", created=100, choices=[choice],
                                             model="m", prompt_token_ids=prompt_ids, prompt_text=None))


def chat_chunk(id_, text, ids):
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text), logprobs=None,
                                                finish_reason=None, token_ids=ids)
    return data(ChatCompletionStreamResponse(id=id_, object="chat.completion.chunk", created=100,
                                             choices=[choice], model="m"))


def events(items) -> list[dict]:
    flat = [x for item in items for x in (item if isinstance(item, list) else [item])]
    return [json.loads(x[6:]) for x in flat if isinstance(x, str) and x.startswith("data: {")]


def completions_body(**kw):
    kw = {"prompt": "the river", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}, **kw}
    return CompletionRequest(model="m", **kw)


def test_which_streams_can_be_continued():
    assert continuable(completions_body(), "completions")
    assert continuable(completions_body(prompt=[3, 4]), "completions")
    assert continuable(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                             stream=True), "chat")
    assert not continuable(completions_body(stream=False, stream_options=None), "completions")
    assert not continuable(completions_body(n=2), "completions")
    assert not continuable(completions_body(logprobs=2), "completions")
    assert not continuable(completions_body(stop=["."]), "completions")
    assert not continuable(completions_body(echo=True), "completions")
    assert not continuable(completions_body(prompt=["a", "b"]), "completions")
    # The client's opt-out, a top-level field as the ingress receives it.
    assert not continuable(CompletionRequest.model_validate(
        {"model": "m", "prompt": "a", "stream": True, "tokenflow_continuation": False}), "completions")
    assert continuable(CompletionRequest.model_validate(
        {"model": "m", "prompt": "a", "stream": True, "tokenflow_continuation": True}), "completions")
    assert not continuable(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, logprobs=True), "chat")


def test_a_stream_may_ask_to_stay_on_its_engine():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "a", "stream": True, "tokenflow_rebalance": False})
    ledger = Ledger(body, "completions", default_rate=40, max_continuations=3)
    assert body.vllm_xargs["tokenflow_movable"] == 0  # never moved, yet continued if its engine is lost
    ledger._note(completion_chunk("cmpl-1", " the", [7], prompt=PROMPT))
    assert ledger.continuation().vllm_xargs["tokenflow_movable"] == 0
    moving = completions_body()
    Ledger(moving, "completions", default_rate=40, max_continuations=0)
    assert moving.vllm_xargs["tokenflow_movable"] == 0  # no continuation to move it with


def test_ids_are_noted_and_hidden_from_a_client_that_did_not_ask():
    body = completions_body(temperature=0, seed=3, vllm_xargs={"consumption_rate": 8})
    ledger = Ledger(body, "completions", default_rate=40, clock=lambda: 10.0)
    assert body.return_token_ids  # asked of the engine for the client
    first = completion_chunk("cmpl-1", " the", [7], prompt=PROMPT)
    out = ledger._note([first, completion_chunk("cmpl-1", " sea", [8, 3])])
    assert ledger.prompt_ids == PROMPT and ledger.sent_ids == [7, 8, 3]
    assert ledger.stream_id == "cmpl-1" and ledger.created == 100
    # The client sees the shape it would without return_token_ids: nulls.
    for ev in events([out]):
        assert ev["choices"][0]["token_ids"] is None and ev["choices"][0]["prompt_token_ids"] is None
    assert [ev["choices"][0]["text"] for ev in events([out])] == [" the", " sea"]
    assert ledger.rate == 8 and ledger.reader().delivered == 3

    # A client that asked keeps its ids.
    shown = Ledger(completions_body(return_token_ids=True), "completions", 40)
    (ev,) = events([shown._note(first)])
    assert ev["choices"][0]["token_ids"] == [7] and ev["choices"][0]["prompt_token_ids"] == PROMPT


def test_a_continuation_asks_for_the_rest_with_the_readers_buffer():
    now = [10.0]
    body = completions_body(temperature=0, seed=3, vllm_xargs={"consumption_rate": 8}, min_tokens=5)
    ledger = Ledger(body, "completions", default_rate=40, clock=lambda: now[0])
    ledger._note(completion_chunk("cmpl-1", " the", [7, 8, 9, 10], prompt=PROMPT))
    now[0] = 10.25  # the reader has read 2 of its 4 tokens
    req = ledger.continuation()
    assert isinstance(req, CompletionRequest) and req.stream and req.return_token_ids
    assert req.prompt == PROMPT + [7, 8, 9, 10] and req.max_tokens == 6 and req.min_tokens == 1
    assert req.temperature == 0 and req.seed == 3
    assert req.vllm_xargs["consumption_rate"] == 8
    assert parse_carried(req.vllm_xargs) == (2.0, 0.25)
    assert ledger.continued == 1
    # Its engine may move it while a continuation is left (routing/rebalance.py).
    assert body.vllm_xargs["tokenflow_movable"] == 1 and req.vllm_xargs["tokenflow_movable"] == 1  # 1 of 2 used
    # Nothing left to generate, or no prompt ids seen: nothing to continue.
    ledger._note(completion_chunk("cmpl-1", "x", [1] * 6))
    assert ledger.continuation() is None
    assert Ledger(completions_body(), "completions", 40).continuation() is None


def test_ids_the_replica_cut_off_are_generated_again_and_not_shown_twice():
    """The ledger asks with every id it sent and says how many are the
    answer's; the replica may cut the last of them (ids whose text vLLM held
    back: `end_on_whole_character`). The continuation's first chunk reports
    the prompt it ran, so the ledger sees the cut: those ids come again,
    their text goes out now, and a client that sees ids gets them once."""
    ledger = Ledger(completions_body(return_token_ids=True), "completions", 40)
    ledger._note(completion_chunk("cmpl-1", " the", [7], prompt=PROMPT))
    # One chunk, two ids: vLLM sent the text of 8 and held back that of 9.
    ledger._note(completion_chunk("cmpl-1", " sea", [8, 9]))
    req = ledger.continuation()
    assert req.prompt == PROMPT + [7, 8, 9] and req.max_tokens == 7 and req.vllm_xargs[SENT_KEY] == 3
    evs = events([ledger._rewrite(x) for x in [
        completion_chunk("cmpl-2", "", [9], prompt=PROMPT + [7, 8]),  # the replica cut 9
        completion_chunk("cmpl-2", "\u00e9", [3]),
        completion_chunk("cmpl-2", " x", [4]), usage_chunk("cmpl-2", 6, 3)]])
    assert [ev["choices"][0]["token_ids"] for ev in evs[:3]] == [[], [3], [4]]  # 9 was shown already
    assert "".join(ev["choices"][0]["text"] for ev in evs[:3]) == "\u00e9 x"
    assert evs[3]["usage"]["completion_tokens"] == 5
    assert ledger.sent_ids == [7, 8, 9, 3, 4]
    # Nothing cut: nothing repeated.
    other = Ledger(completions_body(), "completions", 40)
    other._note(completion_chunk("cmpl-3", "a", [1], prompt=PROMPT))
    other.continuation()
    (ev,) = events([other._rewrite(completion_chunk("cmpl-4", "b", [2], prompt=PROMPT + [1]))])
    assert ev["choices"][0]["text"] == "b" and other.sent_ids == [1, 2]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_model())


def test_the_replica_cuts_a_continuation_back_to_a_whole_character(tokenizer):
    """What the cut prevents, on the detokenizer vLLM uses (tokenizers'
    DecodeStream primed with the prompt): primed with a prompt that ends
    inside a character, its first text is the whole prompt's (seen live,
    when a replica stopped under a chat stream); cut back, only the answer's."""
    from tokenizers.decoders import DecodeStream

    chat = tokenizer.encode("<|user|>\nhi there\n<|assistant|>\n")
    lead, last = tokenizer.encode("\u00e9")  # not in the tiny model's corpus: two byte tokens
    answer = tokenizer.encode(" the river")
    sent = answer + [lead]
    req = CompletionRequest(model="m", prompt=chat + sent, max_tokens=5, min_tokens=2,
                            vllm_xargs={SENT_KEY: len(sent)})
    assert end_on_whole_character(req, tokenizer.decode) == 1
    assert req.prompt == chat + answer and req.max_tokens == 6 and req.min_tokens == 3

    def first_texts(prompt, ids):
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        return "".join(t or "" for t in (stream.step(tokenizer._tokenizer, i) for i in ids))
    assert first_texts(req.prompt, [lead, last]) == "\u00e9"
    assert "hi there" in first_texts(chat + sent, [last])  # uncut: the prompt's text comes out

    # A prompt that ends on a whole character, one that is no continuation,
    # and the client's own prompt (not the answer's ids) are left alone.
    whole = CompletionRequest(model="m", prompt=chat + answer + [lead, last], max_tokens=5,
                              vllm_xargs={SENT_KEY: len(answer) + 2})
    plain = CompletionRequest(model="m", prompt=chat + sent, max_tokens=5)
    own = CompletionRequest(model="m", prompt=chat + [lead, lead], max_tokens=5, vllm_xargs={SENT_KEY: 1})
    assert [end_on_whole_character(r, tokenizer.decode) for r in (whole, plain, own)] == [0, 0, 1]
    assert own.prompt == chat + [lead] and plain.prompt == chat + sent


def test_each_splice_reports_the_gap_and_the_readers_wait():
    now, heard = [0.0], []
    ledger = Ledger(completions_body(vllm_xargs={"consumption_rate": 10}), "completions", 40,
                    clock=lambda: now[0], on_splice=lambda gap, stall: heard.append((gap, stall)))
    ledger._note(completion_chunk("cmpl-1", "ab", [1, 2], prompt=PROMPT))  # 0.2 s of reading at t=0
    now[0] = 0.5
    ledger.continuation()
    now[0] = 0.7
    ledger.continuation()  # the first continuation was lost too: the gap runs on
    now[0] = 1.0
    ledger._rewrite(completion_chunk("cmpl-2", "c", [3]))
    ledger._rewrite(completion_chunk("cmpl-2", "d", [4]))
    assert heard == [(pytest.approx(1.0), pytest.approx(0.8))]


def test_bad_carried_values_are_ignored():
    assert parse_carried({CARRIED_KEY: "lots"}) is None
    assert parse_carried({CARRIED_KEY: -1}) is None
    assert parse_carried({CARRIED_KEY: 3, WAITED_KEY: float("nan")}) is None
    assert parse_carried({"consumption_rate": 4}) is None
    assert parse_carried({CARRIED_KEY: 3}) == (3.0, 0.0)


def test_a_completions_continuation_is_spliced_into_the_same_stream():
    ledger = Ledger(completions_body(), "completions", 40)
    ledger._note(completion_chunk("cmpl-1", " the", [7, 8], prompt=PROMPT))
    ledger.continuation()
    spliced = [ledger._rewrite(x) for x in [
        completion_chunk("cmpl-2", " sea", [5], prompt=PROMPT + [7, 8], created=200),
        [completion_chunk("cmpl-2", " and", [6], finish="length", created=200),
         usage_chunk("cmpl-2", 6, 2, created=200), "data: [DONE]\n\n"]]]
    evs = events(spliced)
    assert {ev["id"] for ev in evs} == {"cmpl-1"} and {ev["created"] for ev in evs} == {100}
    assert [ev["choices"][0]["text"] for ev in evs[:2]] == [" sea", " and"]
    assert all(ev["choices"][0]["prompt_token_ids"] is None and ev["choices"][0]["token_ids"] is None
               for ev in evs[:2])
    assert evs[1]["choices"][0]["finish_reason"] == "length"
    assert evs[2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert spliced[-1][-1] == "data: [DONE]\n\n"
    assert ledger.sent_ids == [7, 8, 5, 6]


def test_a_chat_continuation_becomes_chat_chunks():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                 max_completion_tokens=5, temperature=0, stream_options={"include_usage": True})
    ledger = Ledger(body, "chat", 40)
    out = ledger._note([chat_role_chunk("chatcmpl-1", PROMPT), chat_chunk("chatcmpl-1", "Hel", [3])])
    (role, first) = events([out])
    assert role["prompt_token_ids"] is None and first["choices"][0]["token_ids"] is None
    req = ledger.continuation()
    assert req.prompt == PROMPT + [3] and req.max_tokens == 4 and req.temperature == 0
    evs = events([ledger._rewrite(x) for x in [
        completion_chunk("cmpl-9", "lo", [4], prompt=PROMPT + [3]),
        completion_chunk("cmpl-9", "", [0], finish="stop"),
        usage_chunk("cmpl-9", 5, 2)]])
    assert all(ev["id"] == "chatcmpl-1" and ev["object"] == "chat.completion.chunk" for ev in evs)
    assert evs[0]["choices"] == [{"index": 0, "delta": {"content": "lo"}, "logprobs": None,
                                  "finish_reason": None, "token_ids": None}]
    assert evs[1]["choices"][0]["delta"] == {} and evs[1]["choices"][0]["finish_reason"] == "stop"
    assert evs[2]["usage"]["completion_tokens"] == 3 and evs[2]["usage"]["prompt_tokens"] == 4


# --- the relay -------------------------------------------------------------
def played(script):
    """The stream of one script (tests/test_failover.py's scripted streams)."""
    open_stream, _ = scripted(script)
    return open_stream()


def relayed(first, continuations, max_continuations=2):
    """The relay over a ledger: `first` is the stream as opened; each entry
    of `continuations` is what the next continuation yields."""
    body = completions_body(max_tokens=4)
    ledger = Ledger(body, "completions", 40, max_continuations)
    lost, asked = [], []

    def continue_after(to):  # as the ingress's
        if (req := ledger.continuation()) is None:
            return None
        asked.append(req)
        script = continuations[len(asked) - 1]
        return lambda: ledger.splice(played(script))

    async def collect():
        return [x async for x in relay(lambda: ledger.watch(played(first)), 2, lambda o, cause: lost.append(o),
                                       continue_after=continue_after, closing=ledger.closing)]
    return asyncio.run(collect()), lost, asked


def test_a_stream_lost_mid_answer_is_continued_seamlessly():
    out, lost, asked = relayed(
        [completion_chunk("cmpl-1", "a", [1], prompt=PROMPT), ActorDiedError()],
        [[ActorDiedError()],  # the first continuation is lost before its first token: another
         [completion_chunk("cmpl-2", "b", [2], prompt=PROMPT + [1]),
          completion_chunk("cmpl-2", "cd", [3, 4], finish="length"), usage_chunk("cmpl-2", 5, 3), "data: [DONE]\n\n"]])
    evs = events(out)
    assert "".join(ev["choices"][0]["text"] for ev in evs if ev["choices"]) == "abcd"
    assert {ev["id"] for ev in evs} == {"cmpl-1"} and not any("error" in ev for ev in evs)
    assert evs[-1]["usage"]["completion_tokens"] == 4
    assert lost == ["continued", "continued"]
    assert [r.prompt for r in asked] == [PROMPT + [1]] * 2


@pytest.mark.parametrize("spliced", [False, True])
def test_a_stream_lost_after_its_last_token_is_closed_not_continued(spliced):
    """The engine is lost between the answer's last token (with its finish
    reason) and the closing usage chunk: on the stream as first opened, or
    on a continuation. The ingress sends the usage chunk itself: no error
    event, and no continuation generating past the answer's end."""
    end = [completion_chunk("cmpl-2" if spliced else "cmpl-1", "cd", [3, 4], finish="length"), EngineLost(STOPPING)]
    if spliced:
        first = [completion_chunk("cmpl-1", "a", [1], prompt=PROMPT), ActorDiedError()]
        continuations = [[completion_chunk("cmpl-2", "b", [2], prompt=PROMPT + [1])] + end]
    else:
        first = [completion_chunk("cmpl-1", "ab", [1, 2], prompt=PROMPT)] + end
        continuations = []
    out, lost, asked = relayed(first, continuations)
    evs = events(out)
    assert not any("error" in ev for ev in evs) and len(asked) == len(continuations)
    assert "".join(ev["choices"][0]["text"] for ev in evs if ev["choices"]) == "abcd"
    assert {ev["id"] for ev in evs} == {"cmpl-1"}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == {"prompt_tokens": 4, "total_tokens": 8,
                                                              "completion_tokens": 4}
    assert lost == ["continued"] * spliced + ["finished"]


def test_an_answer_that_ended_early_is_not_continued_past_its_end():
    # Its end token came before max_tokens (finish "stop"): 3 tokens are
    # left by the count, none by the answer.
    out, lost, asked = relayed([completion_chunk("cmpl-1", "a", [1], prompt=PROMPT, finish="stop"),
                                ActorDiedError()], [])
    evs = events(out)
    assert asked == [] and lost == ["finished"] and not any("error" in ev for ev in evs)
    assert evs[-1]["usage"]["completion_tokens"] == 1


def test_continuations_are_bounded_then_the_error_event():
    out, lost, _ = relayed([completion_chunk("cmpl-1", "a", [1], prompt=PROMPT), ActorDiedError()],
                           [[ActorDiedError()], [ActorDiedError()]], max_continuations=2)
    assert lost == ["continued", "continued", "ended_mid_stream"]
    assert LOST_MESSAGE in events(out)[-1]["error"]["message"]


@pytest.mark.parametrize("max_continuations", [0])
def test_with_continuation_off_the_stream_ends_with_the_error_event(max_continuations):
    out, lost, asked = relayed([completion_chunk("cmpl-1", "a", [1], prompt=PROMPT), ActorDiedError()], [],
                               max_continuations=max_continuations)
    evs = events(out)
    assert evs[0]["choices"][0]["text"] == "a" and evs[-1]["error"]["code"] == 503
    assert lost == ["ended_mid_stream"] and asked == []
